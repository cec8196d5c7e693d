"""The prompts a fidelity run captures: needle records, natural prose, and calibration prose.

Each :class:`Prompt` is a token sequence split in two: a *prefix* of ``prefix_len`` tokens (a
multiple of the page size) whose post-RoPE keys and values are measured, and a teacher-forced
*continuation* whose last ``queries`` positions give the decode-time queries.

- needle prompt: a task record's context (the haystack), then its suffix (question, end of
  turn, assistant header, answer prefix) and the reference answer, teacher-forced. The prefix is
  the context trimmed to whole pages (and, for a short suffix, until the last ``queries``
  positions lie after it); the trimmed context tokens join the continuation. The *carrier
  tokens* are the context positions of the asked needle's value (every occurrence: the pass key
  is stated twice), found through the tokenizer's offsets of exactly the record's token ids.
- text prompt: ``length`` tokens of stdlib reference prose (:mod:`kvlocks.corpus`); the
  prefix is the first whole pages of ``length - queries`` tokens, the continuation the rest.
- calibration prose (Loki's PCA, the global basis): prose sentences that occur in none of the
  evaluated prompts, checked sentence by sentence (:func:`calibration_prompt`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvlocks.corpus import calibration_text, natural_units, prose_ids, units_for


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One captured sequence.

    Parameters
    ----------
    name : unique id, e.g. ``"niah_single_text-0"``
    kind : ``"needle"``, ``"text"`` or ``"calibration"``
    ids : all token ids, prefix + continuation
    prefix_len : N, tokens whose keys are measured (a multiple of the page size)
    carrier_tokens : positions in ``[0, N)`` of the needle value's tokens (empty for text)
    task, references, depth : of the source record (needle prompts)
    text : the prompt's text (for the calibration disjointness check)
    """

    name: str
    kind: str
    ids: tuple[int, ...]
    prefix_len: int
    carrier_tokens: tuple[int, ...] = ()
    task: str | None = None
    references: tuple[str, ...] = ()
    depth: float | None = None
    text: str = field(default="", repr=False)

    def meta(self) -> dict:
        """JSON-able description (no token ids, no text)."""
        return {"name": self.name, "kind": self.kind, "prefix_len": self.prefix_len,
                "total_tokens": len(self.ids), "carrier_tokens": list(self.carrier_tokens),
                "task": self.task, "references": list(self.references), "depth": self.depth}


def _whole_pages(n: int, page_size: int) -> int:
    return (n // page_size) * page_size


def value_token_positions(tokenizer, text: str, ids: list[int], value: str, limit: int) -> list[int]:
    """Positions ``< limit`` of the tokens of ``ids`` that overlap an occurrence of ``value``.

    ``ids`` must be the tokenization of ``text`` (checked: a mismatch raises ``ValueError``);
    only occurrences inside ``text[:end of token limit-1]`` count.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc.input_ids[: len(ids)]) != list(ids):
        raise ValueError("re-tokenizing the prompt text does not reproduce its token ids")
    offsets = enc.offset_mapping[:limit]
    spans, at = [], text.find(value)
    while at >= 0:
        spans.append((at, at + len(value)))
        at = text.find(value, at + 1)
    return [i for i, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in spans)]


def needle_prompt(record, tokenizer, *, queries: int, page_size: int) -> Prompt:
    """A :class:`~kvlocks_lab.eval.tasks.TaskRecord` with a numeric needle as a :class:`Prompt`."""
    if not record.references:
        raise ValueError(f"task {record.task!r} has no reference answer to locate as the needle")
    value = record.references[0]
    answer = tokenizer(" " + value, add_special_tokens=False).input_ids
    ids = list(record.context_ids) + list(record.suffix_ids) + list(answer)
    n = _whole_pages(min(len(record.context_ids), len(ids) - queries), page_size)  # queries after the prefix
    if n < page_size:
        raise ValueError(f"{record.task}: a {len(ids)}-token prompt leaves no whole page before {queries} queries")
    text = record.context_text + record.suffix_text
    carriers = value_token_positions(tokenizer, text, list(record.context_ids) + list(record.suffix_ids),
                                     value, n)
    if not carriers:
        raise ValueError(f"{record.task} #{record.index}: needle value {value!r} not found in the measured prefix")
    return Prompt(name=f"{record.task}-{record.index}", kind="needle", ids=tuple(ids), prefix_len=n,
                  carrier_tokens=tuple(carriers), task=record.task, references=tuple(record.references),
                  depth=record.depth, text=text)


def text_prompt(tokenizer, *, length: int, queries: int, page_size: int, index: int, seed: int) -> Prompt:
    """``length`` tokens of natural prose from a seeded offset; no needle."""
    units = natural_units()
    start = random.Random(f"kvlocks-fidelity-text-{seed}-{index}").randrange(len(units))
    chosen = [units[(start + i) % len(units)] for i in range(units_for(length))]
    ids, text = prose_ids(tokenizer, chosen, length)
    n = _whole_pages(length - queries, page_size)
    return Prompt(name=f"text-{index}", kind="text", ids=tuple(ids), prefix_len=n, text=text)


def calibration_prompt(tokenizer, *, tokens: int, avoid: list[str], page_size: int, seed: int) -> Prompt:
    """Prose sentences that appear in none of the texts ``avoid``, ``tokens`` tokens long."""
    ids, text = calibration_text(tokenizer, tokens=tokens + 1, avoid=avoid, seed=seed)  # +1: a query position (unused)
    return Prompt(name="calibration", kind="calibration", ids=tuple(ids),
                  prefix_len=_whole_pages(tokens, page_size), text=text)


def shared_sentences(calibration: Prompt, prompts: list[Prompt]) -> int:
    """Sentences of ``calibration`` found verbatim in any of ``prompts`` (0 for a fair split)."""
    found = 0
    for u in natural_units():
        s = u.strip()
        if s in calibration.text and any(s in p.text for p in prompts):
            found += 1
    return found


def build_prompts(config, tokenizer) -> tuple[list[Prompt], Prompt]:
    """The evaluated prompts of a :class:`~kvlocks_lab.fidelity.config.FidelityConfig` and the
    calibration prompt (disjoint from them; None with ``calib_tokens`` 0)."""
    from kvlocks_lab.eval.tasks import generate

    prompts = []
    for task in config.tasks:
        for rec in generate(task, tokenizer, config.length, config.samples, seed=config.seed):
            prompts.append(needle_prompt(rec, tokenizer, queries=config.queries, page_size=config.page_size))
    for i in range(config.text_records):
        prompts.append(text_prompt(tokenizer, length=config.length, queries=config.queries,
                                   page_size=config.page_size, index=i, seed=config.seed))
    if not config.calib_tokens:
        return prompts, None
    calib = calibration_prompt(tokenizer, tokens=config.calib_tokens, avoid=[p.text for p in prompts],
                               page_size=config.page_size, seed=config.seed)
    return prompts, calib
