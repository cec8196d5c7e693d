"""``kvlocks demo``: a ~4K-token document with a planted fact, answered by full, locks and oracle.

The document is Python's own reference prose (``pydoc_data.topics``, shipped with CPython, so it
is offline and identical everywhere), with one fact planted at a fixed depth. The document is
prefilled densely once per method; the question, the answer prefix and the answer go through
decode steps, so sparse selection acts on every one of them.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.hf.decode import greedy_answer
from kvlocks.integrations.hf import LocksCache

TOPICS = ("execmodel", "exceptions", "naming", "import", "compound", "dynamic-features", "for", "try",
          "with", "class", "function", "assignment", "calls", "comparisons", "booleans", "lambda")
FACT = "Note from the editors: the archive key for this manual is 4817, and it opens the blue cabinet."
QUESTION = "According to the document, what is the archive key for this manual? Answer with the number."
ANSWER_PREFIX = "The archive key for this manual is"
ANSWER = "4817"


def build_document(tokenizer, target_tokens: int = 3800, depth: float = 0.5) -> str:
    """Concatenate reference topics up to ``target_tokens`` and plant :data:`FACT` at ``depth``."""
    from pydoc_data.topics import topics

    paras: list[str] = []
    n = 0
    for name in TOPICS:
        for para in topics[name].split("\n\n"):
            para = " ".join(para.split())
            if len(para) < 40:
                continue
            cost = len(tokenizer(para + "\n\n", add_special_tokens=False).input_ids)
            if n + cost > target_tokens:
                break
            paras.append(para)
            n += cost
    paras.insert(int(len(paras) * depth), FACT)
    return "\n\n".join(paras)


def encode_task(tokenizer, document: str) -> tuple[list[int], list[int]]:
    """Token ids of (context = document turn, suffix = question + assistant header + prefix)."""
    user = f"Read the document and answer the question.\n\n<document>\n{document}\n</document>\n\n{QUESTION}"
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        full = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True) + ANSWER_PREFIX
    else:  # a base model: the same text as a plain continuation, after the tokenizer's BOS
        full = f"{user}\n\n{ANSWER_PREFIX}"
    head = full[: full.index("</document>")]
    ids = tokenizer(full, add_special_tokens=not chat).input_ids
    n_ctx = len(tokenizer(head, add_special_tokens=not chat).input_ids)
    return ids[:n_ctx], ids[n_ctx:]


def run_demo(model, tokenizer, *, budget: int = 256, max_new_tokens: int = 12, methods=("full", "locks", "oracle"),
             progress=None) -> dict:
    """Answer the planted-fact question with each method; returns a JSON-able report.

    ``progress(done, method)``, if given, is called before each method starts (``done`` methods
    finished, ``method`` the one starting) and as ``progress(len(methods), None)`` at the end.
    """
    config = LocksConfig(budget=budget)
    document = build_document(tokenizer)
    ctx, suffix = encode_task(tokenizer, document)
    eos = {tokenizer.eos_token_id, *([tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else [])}
    rows = {}
    for i, method in enumerate(methods):
        if progress:
            progress(i, method)
        cache = LocksCache(model.config, method=method, config=config)
        t0 = time.perf_counter()
        res = greedy_answer(model, cache, torch.tensor([ctx], device=model.device), suffix,
                            max_new_tokens=max_new_tokens, eos_ids=eos)
        text = tokenizer.decode([t for t in res.tokens if t not in eos])
        rows[method] = {"answer": text.strip(), "correct": ANSWER in text, "tokens": res.tokens,
                        "seconds": time.perf_counter() - t0, **cache.stats.summary()}
    if progress:
        progress(len(methods), None)
    ref = rows.get("full")
    if ref:
        for r in rows.values():
            n = max(len(ref["tokens"]), len(r["tokens"]))
            same = sum(a == b for a, b in zip(ref["tokens"], r["tokens"]))
            r["token_agreement"] = same / n if n else 1.0
            r["exact_match_full"] = r["tokens"] == ref["tokens"]
    return {"config": asdict(config), "context_tokens": len(ctx), "decoded_prompt_tokens": len(suffix),
            "question": QUESTION, "expected": ANSWER, "methods": rows}
