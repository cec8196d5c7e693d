"""Validated, frozen configuration of the compaction study (``kvlocks compaction-study``).

The study compacts the context of task-suite records with several methods at a few ratios and
measures, per layer and KV head, the attention-output error on held-out queries near the
context and on the continuation's queries far from it, plus KL to the full cache and task
accuracy per record. Its repr (JSON) goes into ``summary.json``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlocks.config_io import ConfigIO

from kvlocks.compaction.config import BIAS_SOLVERS, METHODS, CompactionConfig

DEFAULT_TASKS = ("qa_doc", "niah_single_text")
DEFAULT_METHODS = ("am", "fold", "drop", "drop_refit", "rank1")


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"StudyConfig.{name}={value!r}: {allowed}")


def _int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")
    if value < low or (high is not None and value > high):
        _fail(name, value, f"must be an integer in [{low}, {'+inf' if high is None else high}]")


def _tuple(name: str, value, kind: type) -> None:
    if not isinstance(value, tuple) or not value:
        _fail(name, value, f"must be a non-empty tuple of {kind.__name__}")
    if len(set(value)) != len(value):
        _fail(name, value, "must not repeat an entry")


@dataclass(frozen=True, kw_only=True)
class StudyConfig(ConfigIO):
    """The grid and the measurement settings of one compaction study.

    Parameters
    ----------
    model : str
        Bundled model name or local Hugging Face directory.
    tasks : tuple of str
        Task-suite tasks (keys of ``kvlocks_lab.eval.tasks.TASKS``) whose records are compacted.
    lengths : tuple of int
        Record target lengths in tokens (prompt + answer budget), each in [256, 8192].
    ratios : tuple of float
        Compaction ratios t/T, each in (0, 1).
    methods : tuple of str
        Compaction methods (``CompactionConfig.METHODS``); must include ``"am"`` and ``"fold"``,
        which every fold/AM comparison needs. ``full`` (no compaction) is always run.
    samples : int
        Records per task and length, >= 1.
    seed : int
        Seed of the records, of the query subsamples and of the held-out split, >= 0.
    max_queries : int
        Reference queries per KV head used for fitting (as ``CompactionConfig.max_queries``).
    heldout : float
        Fraction of the prefill's (context pass) recorded queries held out from fitting and
        used as "near" queries, in (0, 1).
    far_tokens : int
        Natural-text tokens appended after the suffix and full's answer; their queries, with
        the suffix's and the answer's, are the "far" queries. >= 0; the whole record plus these
        tokens must fit the model's positions (checked per record).
    max_new_tokens : int or None
        Cap on the answer length (full's greedy answer and every method's); None keeps each
        task's own budget. Lower it only for quick runs: it can cut an answer short.
    self_study_tokens : int
        Greedy tokens per self-study prompt in the reference passes (as ``ReferenceConfig``).
    bias_solver : str
        Bias solver of every compaction (``CompactionConfig.bias_solver``).
    compare_solvers : bool
        On the first record of each task and length, also fit the bias of 7 layers' heads
        with both solvers and report time and fit quality (:mod:`.study_solvers`).
    dtype, device : str
        Model precision (``float32``, ``bfloat16``, ``float16``) and device.
    """

    model: str = "smollm2-135m"
    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (2048,)
    ratios: tuple[float, ...] = (0.1, 0.05)
    methods: tuple[str, ...] = DEFAULT_METHODS
    samples: int = 4
    seed: int = 0
    max_queries: int = 4096
    heldout: float = 0.25
    far_tokens: int = 1024
    max_new_tokens: int | None = None
    self_study_tokens: int = 32
    bias_solver: str = CompactionConfig.bias_solver
    compare_solvers: bool = True
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        from kvlocks_lab.eval.tasks import TASKS

        if not isinstance(self.model, str) or not self.model:
            _fail("model", self.model, "must be a non-empty string")
        _tuple("tasks", self.tasks, str)
        for task in self.tasks:
            if task not in TASKS:
                _fail("tasks", self.tasks, f"unknown task {task!r}; allowed {sorted(TASKS)}")
        _tuple("lengths", self.lengths, int)
        for n in self.lengths:
            _int("lengths", n, 256, 8192)
        _tuple("ratios", self.ratios, float)
        for r in self.ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < 1.0:
                _fail("ratios", self.ratios, "each ratio must be a number in (0, 1)")
        _tuple("methods", self.methods, str)
        for m in self.methods:
            if m not in METHODS:
                _fail("methods", self.methods, f"unknown method {m!r}; allowed {METHODS}")
        if "am" not in self.methods or "fold" not in self.methods:
            _fail("methods", self.methods, "must include 'am' and 'fold' (the study compares them)")
        _int("samples", self.samples, 1)
        _int("seed", self.seed, 0)
        _int("max_queries", self.max_queries, 16)
        if isinstance(self.heldout, bool) or not isinstance(self.heldout, (int, float)) \
                or not math.isfinite(self.heldout) or not 0.0 < self.heldout < 1.0:
            _fail("heldout", self.heldout, "must be a number in (0, 1)")
        _int("far_tokens", self.far_tokens, 0, 8192)
        if self.max_new_tokens is not None:
            _int("max_new_tokens", self.max_new_tokens, 1, 4096)
        _int("self_study_tokens", self.self_study_tokens, 0, 512)
        if self.bias_solver not in BIAS_SOLVERS:
            _fail("bias_solver", self.bias_solver, f"allowed {BIAS_SOLVERS}")
        if not isinstance(self.compare_solvers, bool):
            _fail("compare_solvers", self.compare_solvers, "must be a bool")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            _fail("dtype", self.dtype, "allowed ('float32', 'bfloat16', 'float16')")
        if not isinstance(self.device, str) or not self.device:
            _fail("device", self.device, "must be a device string such as 'cpu' or 'cuda'")

    @classmethod
    def _from_json_values(cls, data: dict) -> dict:
        """JSON lists become the tuples the fields hold (``from_json`` is the mixin's strict parser)."""
        return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}

    def answer_budget(self, task_budget: int) -> int:
        """Answer tokens for a task whose own budget is ``task_budget``."""
        return task_budget if self.max_new_tokens is None else min(task_budget, self.max_new_tokens)

    def compaction(self, method: str, ratio: float) -> CompactionConfig:
        """The :class:`CompactionConfig` of one (method, ratio) cell."""
        return CompactionConfig(method=method, ratio=float(ratio), max_queries=self.max_queries,
                                seed=self.seed, bias_solver=self.bias_solver)
