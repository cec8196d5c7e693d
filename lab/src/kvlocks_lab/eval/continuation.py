"""Natural-text continuations for perplexity: ``ppl_continuation`` records.

A record is L consecutive tokens of natural prose (:func:`kvlocks.corpus.natural_units`,
the stdlib's reference text): a context of P = L - N tokens, then the N tokens whose
log-probabilities are measured. No chat template: this is plain language modelling (for a base
model whose tokenizer starts every text with BOS, such as Gemma's, the window's first token is
BOS). Record i
starts at sentence ``floor(d_i * #sentences)`` with ``d_i`` the golden-ratio sequence of
:func:`~kvlocks_lab.eval.tasks.build.record_depth`, so any number of records is spread evenly over
the corpus. The corpus is small (about 45K tokens, 1.7K sentences, wrapping around), so at
long L records share text: ten 8K-token records cover it almost twice.

Every one of the N predictions is made with the method active. The first P - 1 context
tokens are prefilled densely (and compacted, for compaction methods); the last context token
and the first N - 1 continuation tokens are then fed one decode step at a time, teacher-forced
on the true text, and the step fed token ``P - 1 + i`` predicts continuation token ``i``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvlocks.corpus import natural_units
from kvlocks_lab.eval.tasks.build import plain_bos, record_depth

PPL_TASK = "ppl_continuation"
MIN_CONTEXT = 32  # P - 1 prefilled tokens: at least two full pages at the default page size


@dataclass(frozen=True, kw_only=True)
class ContinuationRecord:
    """One natural-text window of L = P + N tokens.

    Parameters
    ----------
    task : str
        Always :data:`PPL_TASK`.
    length : int
        L, context plus continuation tokens.
    index, seed : int
        Record number and seed; the start sentence depends on them, not on L.
    context_ids : list of int, length P
        The context.
    target_ids : list of int, length N
        The continuation whose tokens are predicted.
    start : int
        Index of the first sentence in :func:`natural_units`.
    """

    task: str
    length: int
    index: int
    seed: int
    context_ids: list[int]
    target_ids: list[int]
    start: int
    depth: None = None  # no needle: keeps rows uniform with the task records

    @property
    def prefill_ids(self) -> list[int]:
        """The first P - 1 context tokens: prefilled densely (and compacted)."""
        return self.context_ids[:-1]

    @property
    def feed_ids(self) -> list[int]:
        """N tokens decoded one at a time: the last context token, then targets 0 .. N-2."""
        return self.context_ids[-1:] + self.target_ids[:-1]

    @property
    def prompt_tokens(self) -> int:
        return len(self.context_ids)

    def to_dict(self) -> dict:
        return asdict(self)


def continuation_record(tokenizer, length: int, new_tokens: int, index: int, seed: int = 0) -> ContinuationRecord:
    """Record ``index``: L = ``length`` tokens of prose, the last ``new_tokens`` predicted."""
    for name, value, low in (("length", length, MIN_CONTEXT + 2), ("new_tokens", new_tokens, 1), ("index", index, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r}: must be an integer >= {low}")
    if length - new_tokens < MIN_CONTEXT + 1:
        raise ValueError(f"new_tokens={new_tokens} leaves a context of {length - new_tokens} tokens at "
                         f"length={length}; the context needs at least {MIN_CONTEXT + 1}")
    units = natural_units()
    lead = [tokenizer.bos_token_id] if not getattr(tokenizer, "chat_template", None) and plain_bos(tokenizer) else []
    start = int(record_depth(PPL_TASK, seed, index) * len(units)) % len(units)
    ids: list[int] = []
    take = max(16, length // 8)  # sentences per round (~20 tokens each), wrapping around the corpus
    n = 0
    while len(lead) + len(ids) < length:
        n += take
        if n > 4 * len(units):
            raise ValueError(f"length={length}: the natural-text corpus is too short for it")
        text = "".join(units[(start + i) % len(units)] for i in range(n))
        ids = tokenizer(text, add_special_tokens=False).input_ids
    ids = (lead + list(ids))[:length]
    p = length - new_tokens
    return ContinuationRecord(task=PPL_TASK, length=length, index=index, seed=seed,
                              context_ids=ids[:p], target_ids=ids[p:], start=start)


def generate_continuations(tokenizer, length: int, n: int, new_tokens: int, seed: int = 0) -> list[ContinuationRecord]:
    """Records ``0 .. n-1`` at length ``length`` (see :func:`continuation_record`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n={n!r}: must be an integer >= 0")
    return [continuation_record(tokenizer, length, new_tokens, i, seed) for i in range(n)]
