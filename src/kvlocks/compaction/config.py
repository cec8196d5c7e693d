"""Validated, frozen configuration for Attention-Matching compaction and the bias fold.

Every field is keyword-only; an invalid value raises ``ValueError`` naming the field, the value
and what is allowed, so a typo never turns into a silently different experiment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlocks.config_io import ConfigIO

METHODS = ("am", "fold", "drop", "drop_refit", "rank1", "merge_fold")
SELECTIONS = ("attention", "omp")
ROUND_DTYPES = ("bfloat16", "float16", "float32")
BIAS_SOLVERS = ("active_set",)
# scipy's lsq_linear method names, as cache files and result files may give them: the same
# problem, solved to the same optimum (objectives within 1e-9 relative, tests/test_compaction_solvers.py)
_SOLVER_SYNONYMS = {"bvls": "active_set", "trf": "active_set"}


def _fail(name: str, value, allowed: str) -> None:
    raise ValueError(f"CompactionConfig.{name}={value!r}: {allowed}")


def _check_real(name: str, value, low: float | None = None, high: float | None = None,
                *, low_open: bool = False) -> None:
    """Finite int/float within [low, high] (or (low, high] when ``low_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, value, "must be a finite number")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "+inf" if high is None else f"{high}"
        _fail(name, value, f"must be in {'(' if low_open else '['}{lo}, {hi}]")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")
    if value < low:
        _fail(name, value, f"must be an integer >= {low}")


def _check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(name, value, f"allowed {allowed}")


@dataclass(frozen=True, kw_only=True)
class CompactionConfig(ConfigIO):
    """Configuration of one compaction run (same for every layer and KV head).

    Parameters
    ----------
    ratio : float
        Fraction of keys kept per KV head, 0 < ratio <= 1. The budget is
        ``t = max(1, round(ratio * T))`` (see :meth:`budget`); an explicit ``t`` passed to
        :func:`~kvlocks.compaction.compact_head` overrides it. Default 0.1.
    method : str
        ``"am"`` (keep beta: needs a bias-aware kernel), ``"fold"`` (beta folded into the keys),
        ``"drop"`` (AM's keys and values, beta discarded), ``"drop_refit"`` (beta discarded,
        values refit without bias), ``"rank1"`` (beta as an extra key coordinate, head dim D+1),
        ``"merge_fold"`` (near-duplicate keys merged with bias log(count), then folded).
    selection : str
        Key selection: ``"attention"`` (RMS softmax weight over reference queries) or ``"omp"``
        (greedy non-negative matching pursuit on the partition functions).
    beta_min, beta_max : float
        Box for the fitted bias; beta_min < beta_max. Default [-3, 3] as in AM.
    fold_lambda : float
        Ridge of the fold direction, lambda = fold_lambda * tr(Sigma) / D; >= 0. Default 1e-2.
    max_queries : int
        Cap on reference queries per head; more are subsampled without replacement. >= 1.
    seed : int
        Seed of that subsample (the same rows are used for every head). >= 0.
    ridge : float
        Relative ridge of the value least squares: ridge * (mean diagonal of P^T P); >= 0.
    merge_threshold : float
        Cosine similarity at or above which a dropped key is merged into a kept key
        (``"merge_fold"``); in [-1, 1]. Default 0.98.
    round_dtype : str
        Storage dtype the folded keys are rounded to (then returned as float32):
        ``"bfloat16"`` (default), ``"float16"`` or ``"float32"`` (no rounding).
    bias_solver : str
        Solver of the box-constrained bias fit: ``"active_set"`` (default and only choice),
        the exact float64 active-set solver of :mod:`~kvlocks.compaction.solvers` (pure
        PyTorch). On 40 fits of the bundled model's heads (a 2K prefix; t = 1 to 500, n = 100
        to 4096 queries) its objective was never above that of scipy's
        ``lsq_linear(method="bvls")`` or ``"trf"`` by more than 2e-16 relative (5e-25 absolute
        where n < t allows an exact fit, objective 0). When read from JSON
        (cache and result files), scipy's method names ``"bvls"`` and ``"trf"`` mean
        ``"active_set"``: the same problem solved to the same optimum.
    question_share : float
        With questions known when compacting (``kvlocks compact --question``; their query
        rows passed as ``question``), the share of each head's t slots kept for the keys the
        question's rows attend to most (largest max softmax weight over those rows), the rest
        by RMS; in [0, 1], 0 for none (:mod:`~kvlocks.compaction.select`). ``"attention"``
        selection only; without questions nothing changes. Default 0.25.
    coverage_share : float
        Share of each head's t slots kept for the keys of largest ridge leverage in key space
        (facts no reference query reads; :mod:`~kvlocks.compaction.select`); in [0, 1], with
        ``question_share + coverage_share <= 1``; 0 for none. Default 0.25.
    value_anchor : float
        Relative pull of each refit value towards the kept key's own value (merged keys: their
        mean), >= 0 (:func:`~kvlocks.compaction.values.refit_values`); 0 for none. Default 1e-3.
        Read from JSON, a file made before these two fields existed has both at 0.
    """

    ratio: float = 0.1
    method: str = "fold"
    selection: str = "attention"
    beta_min: float = -3.0
    beta_max: float = 3.0
    fold_lambda: float = 1e-2
    max_queries: int = 4096
    seed: int = 0
    ridge: float = 1e-6
    merge_threshold: float = 0.98
    round_dtype: str = "bfloat16"
    bias_solver: str = "active_set"
    question_share: float = 0.25
    coverage_share: float = 0.25
    value_anchor: float = 1e-3

    def __post_init__(self) -> None:
        _check_real("ratio", self.ratio, 0.0, 1.0, low_open=True)
        _check_choice("method", self.method, METHODS)
        _check_choice("selection", self.selection, SELECTIONS)
        _check_real("beta_min", self.beta_min)
        _check_real("beta_max", self.beta_max)
        if self.beta_min >= self.beta_max:
            _fail("beta_max", self.beta_max, f"must be > beta_min={self.beta_min}")
        _check_real("fold_lambda", self.fold_lambda, 0.0)
        _check_int("max_queries", self.max_queries, 1)
        _check_int("seed", self.seed, 0)
        _check_real("ridge", self.ridge, 0.0)
        _check_real("merge_threshold", self.merge_threshold, -1.0, 1.0)
        _check_choice("round_dtype", self.round_dtype, ROUND_DTYPES)
        _check_choice("bias_solver", self.bias_solver, BIAS_SOLVERS)
        _check_real("question_share", self.question_share, 0.0, 1.0)
        _check_real("coverage_share", self.coverage_share, 0.0, 1.0)
        if self.question_share + self.coverage_share > 1.0:
            _fail("coverage_share", self.coverage_share,
                  f"question_share + coverage_share must be <= 1 (question_share={self.question_share})")
        _check_real("value_anchor", self.value_anchor, 0.0)

    @classmethod
    def _from_json_values(cls, data: dict) -> dict:
        """Map scipy's solver names in ``bias_solver`` to the solver that replaces them."""
        solver = data.get("bias_solver")
        if isinstance(solver, str) and solver in _SOLVER_SYNONYMS:
            data = {**data, "bias_solver": _SOLVER_SYNONYMS[solver]}
        return {"coverage_share": 0.0, "value_anchor": 0.0, **data}  # files made before they existed

    def budget(self, num_tokens: int) -> int:
        """Keys kept out of ``num_tokens``: ``max(1, round(ratio * num_tokens))``."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 1 to compute a budget")
        return min(num_tokens, max(1, round(self.ratio * num_tokens)))
