"""The settings every evaluation run shares: model, methods, budgets, LOCKS knobs, compaction.

:class:`GridSettings` is the base of :class:`kvlocks_lab.eval.suite.EvalConfig` (the built-in
tasks) and :class:`kvlocks_lab.eval.records_run.RecordsConfig` (a user's records file); errors
name the subclass (``EvalConfig.methods: ...``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlocks.config_io import ConfigIO, check_int
from kvlocks.config import LocksConfig


QUESTION_READS = ("method", "dense")


@dataclass(frozen=True, kw_only=True)
class GridSettings(ConfigIO):
    """``methods``: ``full``, selectors (run once per budget) and compactions ``NAME@RATIO`` (once
    per record; :mod:`kvlocks_lab.eval.methods`), canonicalised. ``compaction_max_queries`` and
    ``compaction_self_study_tokens``: reference queries per KV head, and greedy tokens per
    self-study prompt, of every compaction method. ``question``: how a record's question (the
    tokens after the context) is read: ``"method"`` decodes it through the method, selection
    included; ``"dense"`` reads it with full attention, as a serving engine prefills the whole
    prompt, and the method selects from the first answer token on."""

    model: str = "smollm2-135m"
    budgets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    methods: tuple[str, ...] = ("full", "locks", "oracle", "quest")
    dtype: str = "float32"
    device: str = "cpu"
    rank: int = 8
    basis_bits: int = 4
    combine: str = "mean_share"
    compaction_max_queries: int = 4096
    compaction_self_study_tokens: int = 32
    question: str = "method"

    def _check_methods(self) -> None:
        from kvlocks_lab.eval.methods import parse_methods

        try:
            specs = parse_methods(self.methods)
        except ValueError as exc:
            raise ValueError(f"{type(self).__name__}.methods: {exc}") from None
        object.__setattr__(self, "methods", tuple(s.name for s in specs))  # canonical spellings

    def _check_budgets_and_compaction(self) -> None:
        name = type(self).__name__
        if not self.budgets:
            raise ValueError(f"{name}.budgets: at least one budget is required")
        for b in self.budgets:  # validated by LocksConfig, which names the rule
            self.locks_config(b)
        check_int(name, "compaction_max_queries", self.compaction_max_queries, 1)
        check_int(name, "compaction_self_study_tokens", self.compaction_self_study_tokens, 0)
        if self.question not in QUESTION_READS:
            raise ValueError(f"{name}.question={self.question!r}: allowed {QUESTION_READS} (the question decoded "
                             "through the method, or read with full attention as a serving engine prefills it)")

    def locks_config(self, budget: int) -> LocksConfig:
        return LocksConfig(budget=budget, rank=self.rank, basis_bits=self.basis_bits, combine=self.combine)
