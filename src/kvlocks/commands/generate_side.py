"""``kvlocks generate --method full,locks,oracle``: several methods from one prefill, side by side.

The prompt except its last token is prefilled once, densely, into a LOCKS cache (summaries
built); each method then generates from its own fork of that cache, so its first step is the
prompt's last token and every later token is a decode step under the method.
"""

from __future__ import annotations

import json

import torch

from kvlocks.commands.common import human_bytes

TEXT_WIDTH = 72


def run_side_by_side(args, model, tok, enc, config, prepare, gen: dict) -> int:
    """Generate with every method of ``args.method`` (``prepare(name)``: the cache's method,
    ``gen``: ``generate``'s options); print a table (or one JSON object)."""
    from kvlocks.integrations.hf import LocksCache, cache_kwargs
    from kvlocks.integrations.hf.decode import prefill

    ids = enc.input_ids  # [1, T]
    if ids.shape[1] < 2:
        raise ValueError("the prompt is one token long: several methods need at least two (one prefilled)")
    base = LocksCache(model.config, method="locks", config=config)
    with torch.inference_mode():
        prefill(model, base, ids[:, :-1])
    results = []
    for name in args.method.split(","):
        cache = base.fork(method=prepare(name))
        torch.manual_seed(args.seed)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen, **cache_kwargs(model, cache))
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        results.append({"method": name, "text": text, "stats": cache.stats.summary(),
                        "config": json.loads(cache.config.to_json())})  # the method's own (e.g. its rerank)
    if args.json:
        print(json.dumps({"methods": results, "config": json.loads(config.to_json()),
                          "prompt_tokens": ids.shape[1], "answer_prefix": args.answer_prefix or ""}))
        return 0
    print(table(results, ids.shape[1], config.budget))
    return 0


def _cell(text: str) -> str:
    flat = " ".join(text.replace("|", "\\|").split())
    return flat if len(flat) <= TEXT_WIDTH else flat[: TEXT_WIDTH - 1] + "…"


def table(results: list[dict], prompt_tokens: int, budget: int) -> str:
    """A markdown table: method, tokens attended and bytes read per step and layer, the answer."""
    lines = [f"prompt {prompt_tokens} tokens; budget {budget} tokens per layer and KV head (selectors)", "",
             "| method | attended / context tokens | read per step and layer | % of full | answer |",
             "|---|---|---|---|---|"]
    for r in results:
        st = r["stats"]
        att, read, pct = "—", "—", "—"
        if st.get("decode_steps"):
            att = f"{st['tokens_attended']:.0f} / {st['context_tokens']:.0f}"
            read, pct = human_bytes(st["bytes_read"]), f"{100 * st['read_fraction']:.1f}"
        lines.append(f"| {r['method']} | {att} | {read} | {pct} | {_cell(r['text'])} |")
    return "\n".join(lines)
