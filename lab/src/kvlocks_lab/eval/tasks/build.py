"""Turning a :class:`Draft` into a :class:`TaskRecord` that fits a target length.

Three steps, each a small function here:

1. randomness: :func:`record_rng` and :func:`record_depth` derive everything from
   ``(task, seed, index)`` through SHA-256 (never Python's salted ``hash``), so records are
   identical across processes and machines;
2. layout: :func:`weave` plants needles among filler units at depth fractions, and
   :func:`encode` renders the chat template (plain text for a base model, which has none:
   :func:`plain_prompt`), tokenizes it and splits it into context and suffix;
3. fitting: :func:`fit` finds the largest number of filler units whose prompt plus the
   generation budget stays within L tokens under the real tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import random
from itertools import accumulate
from typing import Callable

from kvlocks_lab.eval.tasks.record import Draft, TaskRecord

log = logging.getLogger(__name__)

_GOLDEN = 0.6180339887498949  # frac(golden ratio): consecutive indices spread evenly over [0, 1)


def _digest(*parts) -> int:
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")


def record_rng(task: str, seed: int, index: int) -> random.Random:
    """The random stream of one record, independent of the target length."""
    return random.Random(_digest("kvlocks-task", task, seed, index))


def record_depth(task: str, seed: int, index: int) -> float:
    """Requested needle depth of record ``index``: a golden-ratio sequence in [0, 1).

    Any prefix of the records covers [0, 1) almost evenly (a low-discrepancy sequence), so
    depth heat maps get every bin filled even with few samples, and record ``i`` does not
    depend on how many records are generated.
    """
    phase = _digest("kvlocks-depth", task, seed) / 2.0**64
    return (phase + index * _GOLDEN) % 1.0


def weave(units: list[str], needles: list[tuple[float, str]]) -> tuple[list[str], tuple[float, ...]]:
    """Insert needle texts among filler units at depth fractions.

    Parameters
    ----------
    units : list of str
        Filler units in order, each with its own trailing separator.
    needles : list of (depth, text)
        A needle at depth d goes before unit ``round(d * len(units))``; ties keep list order.

    Returns
    -------
    pieces : list of str
        Units and needles interleaved.
    depths : tuple of float
        Realised depth of each needle (in input order): the share of filler characters that
        precede it, in [0, 1].
    """
    n = len(units)
    total = sum(map(len, units))
    before = [0, *accumulate(map(len, units))]  # before[k] = characters in units[:k]
    slots = [min(n, max(0, round(d * n))) for d, _ in needles]
    order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
    pieces: list[str] = []
    k = 0
    for i in order:
        pieces.extend(units[k : slots[i]])
        k = max(k, slots[i])
        pieces.append(needles[i][1])
    pieces.extend(units[k:])
    depths = tuple(before[s] / total if total else needles[i][0] for i, s in enumerate(slots))
    return pieces, depths


def plain_bos(tokenizer) -> str:
    """The BOS token's text when the tokenizer's default encoding starts with it (Gemma), else "".

    A prompt rendered without a chat template is tokenized with ``add_special_tokens=False``
    (so that its split is exact); it starts with this text instead, as the default encoding would.
    """
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or getattr(tokenizer, "bos_token_id", None) is None:
        return ""
    ids = tokenizer("a").input_ids
    return bos if ids and ids[0] == tokenizer.bos_token_id else ""


def plain_prompt(tokenizer, body: str, answer_prefix: str) -> str:
    """A base model's prompt: ``[BOS] body`` then ``answer_prefix`` on a new paragraph.

    :func:`make_record` leaves the task's preamble (an instruction to an assistant) out of a base
    model's ``body``: the document, then the question, which names what it asks about. A small
    base model copies from an instruction above the document: Gemma 3 270M continued "The pass
    key is" with "hidden somewhere in the long text below" on one of two 1K passkey records with
    it, and answered 8 of 8 passkey and single-needle records (1K, greedy, fp32) without it.
    """
    return f"{plain_bos(tokenizer)}{body}\n\n{answer_prefix}" if answer_prefix else f"{plain_bos(tokenizer)}{body}"


def encode(tokenizer, user_context: str, question: str, answer_prefix: str) -> tuple[str, str, list[int], list[int]]:
    """Render the chat template, tokenize it once and split the ids where the question starts.

    A tokenizer without a chat template (a base model) gets the plain-text continuation
    :func:`plain_prompt` of ``user_context + question`` (no turns, no headers).

    Returns ``(context_text, suffix_text, context_ids, suffix_ids)``. The context is the
    template's prefix up to and including ``user_context``; the suffix is ``question`` + end of
    user turn + assistant header + ``answer_prefix``. The whole prompt is tokenized in one go
    (``add_special_tokens=False``: the template already holds the special tokens), so
    ``context_ids + suffix_ids`` is exactly the dense prompt's tokenization; the split is the
    first token that starts at or after the question (a token straddling the boundary, such as
    a merged run of newlines, stays in the context). Tokenizers without offset mappings fall
    back to tokenizing the two texts separately.
    """
    if not getattr(tokenizer, "chat_template", None):
        full = plain_prompt(tokenizer, user_context + question, answer_prefix)
        return split_prompt(tokenizer, full, full.rfind(question))
    messages = [{"role": "user", "content": user_context + question}]
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full += answer_prefix
    cut = full.rfind(question)
    if cut < 0:
        raise ValueError("the chat template altered the question text; cannot split the prompt")
    return split_prompt(tokenizer, full, cut)


def split_prompt(tokenizer, full: str, cut: int, *, straddle: str = "context") -> tuple[str, str, list[int], list[int]]:
    """Tokenize the prompt ``full`` once and split its ids at character ``cut``.

    Returns ``(context_text, suffix_text, context_ids, suffix_ids)``. A token straddling ``cut``
    stays in the context (``straddle="context"``: the split is the first token that starts at or
    after ``cut``, see :func:`encode`) or goes to the suffix (``"suffix"``: the first token that
    ends after ``cut``, e.g. the " Question" of a question that follows a space).
    """
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        ctx_ids = tokenizer(full[:cut], add_special_tokens=False).input_ids
        sfx_ids = tokenizer(full[cut:], add_special_tokens=False).input_ids
        return full[:cut], full[cut:], list(ctx_ids), list(sfx_ids)
    ids, offsets = list(enc.input_ids), enc.offset_mapping
    if straddle == "suffix":
        n_ctx = next((i for i, (_, end) in enumerate(offsets) if end > cut), len(ids))
    else:
        n_ctx = next((i for i, (start, _) in enumerate(offsets) if start >= cut), len(ids))
    at = offsets[n_ctx][0] if n_ctx < len(ids) else len(full)
    return full[:at], full[at:], ids[:n_ctx], ids[n_ctx:]


def fit(count: Callable[[int], int], budget: int, low: int, probe: int = 16) -> int:
    """Largest ``n >= low`` with ``count(n) <= budget``, assuming ``count`` roughly increases.

    A linear estimate from ``count(low)`` and ``count(low + probe)`` gives a first guess; a
    galloping search and a bisection then settle on the answer in a handful of calls. The
    returned ``n`` has itself been checked to fit.

    Raises
    ------
    ValueError
        If even ``count(low)`` exceeds the budget.
    """
    c_low = count(low)
    if c_low > budget:
        raise ValueError(f"needs {c_low} tokens with the fewest filler units ({low}); budget {budget}")
    lo, hi = low, low + probe
    c_hi = count(hi)
    if c_hi <= budget:
        rate = max((c_hi - c_low) / probe, 1e-3)  # tokens per filler unit
        lo = hi
        guess = hi + int((budget - c_hi) / rate)
        if count(guess) <= budget:
            step = 4
            lo, hi = guess, guess + step
            while count(hi) <= budget:
                lo, step = hi, step * 2
                hi = lo + step
        else:
            hi = guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def make_record(spec, tokenizer, length: int, index: int, seed: int) -> TaskRecord:
    """Build record ``index`` of task ``spec`` (a :class:`~kvlocks_lab.eval.tasks.spec.TaskSpec`)."""
    rng = record_rng(spec.name, seed, index)
    draft: Draft = spec.draft(rng, record_depth(spec.name, seed, index))
    memo: dict[int, tuple] = {}
    base = not getattr(tokenizer, "chat_template", None)  # plain text, no preamble (plain_prompt)

    def render(n: int) -> tuple:
        if n not in memo:
            text, depths = draft.body(n)
            user = f"{text.strip()}\n\n" if base else f"{draft.preamble}\n\n{text.strip()}\n\n"
            memo[n] = (*encode(tokenizer, user, draft.question, draft.answer_prefix), depths)
        return memo[n]

    def count(n: int) -> int:
        _, _, ctx, sfx, _ = render(n)
        return len(ctx) + len(sfx)

    budget = length - spec.max_new_tokens
    try:
        n = fit(count, budget, draft.min_units)
    except ValueError as err:
        raise ValueError(f"task {spec.name!r}: length={length} is too small ({err})") from None
    ctx_text, sfx_text, ctx, sfx, depths = render(n)
    log.debug("%s L=%d #%d: %d filler units, %d+%d prompt tokens, %d tried", spec.name, length,
              index, n, len(ctx), len(sfx), len(memo))
    return TaskRecord(
        task=spec.name, length=length, index=index, seed=seed, context_ids=ctx, suffix_ids=sfx,
        references=list(draft.references), depth=depths[0] if depths else None,
        needle_depths=list(depths), max_new_tokens=spec.max_new_tokens, metric=spec.metric,
        shape=spec.shape, context_text=ctx_text, suffix_text=sfx_text,
    )
