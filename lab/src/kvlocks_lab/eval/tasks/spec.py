"""``TaskSpec``: the frozen, validated description of one task of the suite."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from kvlocks_lab.eval.tasks.build import make_record
from kvlocks_lab.eval.tasks.record import Draft, TaskRecord
from kvlocks_lab.eval.tasks.scoring import METRICS, SHAPES


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task: how to draw an instance, how much to generate, and how to score it.

    Parameters
    ----------
    name : str
        Registry name, e.g. ``"niah_multikey"``.
    draft : callable
        ``draft(rng: random.Random, depth: float) -> Draft``; task parameters (hops, number of
        distractors, ...) are bound beforehand with :func:`functools.partial`.
    metric : str
        ``"all"`` (string_match_all) or ``"part"`` (string_match_part).
    shape : str
        Answer shape for the strict score, a key of :data:`~kvlocks_lab.eval.tasks.scoring.SHAPES`.
    max_new_tokens : int
        Generation budget, reserved inside the target length; >= 1.
    description : str
        One line for tables and ``--help``.
    """

    name: str
    draft: Callable[[random.Random, float], Draft]
    metric: str
    shape: str
    max_new_tokens: int
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TaskSpec.name={self.name!r}: must be a non-empty string")
        if not callable(self.draft):
            raise ValueError(f"TaskSpec.draft={self.draft!r}: must be callable")
        if self.metric not in METRICS:
            raise ValueError(f"TaskSpec.metric={self.metric!r}: allowed {METRICS}")
        if self.shape not in SHAPES:
            raise ValueError(f"TaskSpec.shape={self.shape!r}: allowed {tuple(SHAPES)}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"TaskSpec.max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")

    def record(self, tokenizer, length: int, index: int, seed: int = 0) -> TaskRecord:
        """Record ``index`` of this task at target length ``length``."""
        return make_record(self, tokenizer, length, index, seed)

    def __call__(self, tokenizer, length: int, n: int, seed: int = 0) -> list[TaskRecord]:
        """Records ``0 .. n-1`` at target length ``length``."""
        return [self.record(tokenizer, length, i, seed) for i in range(n)]
