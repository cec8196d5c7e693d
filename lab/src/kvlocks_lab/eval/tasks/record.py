"""The data types of the task suite: a fitted :class:`TaskRecord` and the unfitted :class:`Draft`.

A record is what a runner consumes: the context ids (prefilled densely), the suffix ids
(question, end of the user turn, assistant header and answer prefix, decoded token by token),
the expected answers and how to score them. ``len(context_ids) + len(suffix_ids) +
max_new_tokens <= length`` always holds under the tokenizer the record was built with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

Body = Callable[[int], "tuple[str, tuple[float, ...]]"]


@dataclass(frozen=True, kw_only=True)
class Draft:
    """One task instance before it is fitted to a target length.

    Parameters
    ----------
    preamble : str
        Instruction at the top of the user turn, before the haystack.
    body : callable
        ``body(n) -> (text, depths)``: the haystack with ``n`` filler units (sentences, list
        rounds, JSON pairs, words) and the needles woven in; ``depths`` gives each needle's depth
        fraction in [0, 1], the first being the needle the question is about. Must be a pure
        function of ``n`` (it is called many times while fitting).
    question : str
        The question, at the end of the user turn.
    answer_prefix : str
        Text placed right after the assistant header; the model continues it.
    references : tuple of str
        Expected answers.
    min_units : int
        The smallest ``n`` for which the task is well posed.
    """

    preamble: str
    body: Body
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    min_units: int = 1


@dataclass(frozen=True, kw_only=True)
class TaskRecord:
    """One prompt of one task at one target length, tokenized and split for sparse decode.

    Parameters
    ----------
    task : str
        Task name, a key of :data:`kvlocks_lab.eval.tasks.TASKS`.
    length : int
        Target length L in tokens: prompt plus ``max_new_tokens`` never exceeds it.
    index, seed : int
        Record number within the call and the seed; together with ``task`` they determine
        every random choice (the needles do not depend on ``length``).
    context_ids : list of int, length ``T_ctx``
        Chat-template prefix, instruction and haystack (a base model: BOS and the haystack);
        prefilled densely.
    suffix_ids : list of int, length ``T_sfx``
        Question + end of user turn + assistant header + answer prefix; decoded token by token.
    references : list of str
        Expected answers (all of them must be reported where ``metric == "all"``).
    depth : float or None
        Depth fraction in [0, 1] of the needle the question is about (share of haystack
        characters before it); None for tasks without a needle.
    needle_depths : list of float
        Depth of every planted needle (asked one first, then the others, distractors included).
    max_new_tokens : int
        Generation budget reserved inside ``length``.
    metric : str
        ``"all"`` (string_match_all) or ``"part"`` (string_match_part).
    shape : str
        Key of :data:`kvlocks_lab.eval.tasks.scoring.SHAPES`: what an answer looks like, for the
        strict score.
    context_text, suffix_text : str
        The decoded-equivalent texts of the two parts, for debugging.
    """

    task: str
    length: int
    index: int
    seed: int
    context_ids: list[int]
    suffix_ids: list[int]
    references: list[str]
    depth: float | None
    max_new_tokens: int
    metric: str
    shape: str
    needle_depths: list[float] = field(default_factory=list)
    context_text: str = ""
    suffix_text: str = ""

    @property
    def prompt_tokens(self) -> int:
        """Context plus suffix tokens."""
        return len(self.context_ids) + len(self.suffix_ids)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """``(task, length, seed, index)``: identifies the record across runs (for resuming)."""
        return (self.task, self.length, self.seed, self.index)

    def to_dict(self) -> dict:
        """A JSON-able dict (lists and plain scalars only)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> "TaskRecord":
        """Inverse of :meth:`to_dict`."""
        return cls(**row)
