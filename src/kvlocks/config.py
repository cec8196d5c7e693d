"""Validated, frozen configuration: LOCKS sparse decode (:class:`LocksConfig`) and how its kernels
are launched (:class:`KernelOptions`).

Every field is keyword-only; invalid values raise ``ValueError`` naming the field, the value
and what is allowed, so a typo never turns into a silently different experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from kvlocks import env
from kvlocks.config_io import ConfigIO, check_int

COMBINE_RULES = ("mean_share", "max_share", "sum_mass")
BASIS_BITS = (2, 4, 8, 16)
COEF_BITS = (8, 16)
RERANK_SCORES = ("summary", "centroid")

# The default selection (``LocksConfig.rerank="auto"``): the exact re-rank of 4 (k - 2) summary
# candidates where a step keeps fewer than 30 free pages (k - sink - recent; a budget below 512
# tokens at 16-token pages), flat Eq. 4 scoring from 30 on. Measured on the task suite (paired
# bootstrap, docs/evaluation.md#the-default-selection): at 6 free pages flat LOCKS trails the exact
# oracle by 7.5 points on Gemma 3 at 8K-32K and 5.6 on SmolLM2 at 4K-8K, and the re-rank of 4 (k - 2)
# candidates is 0.8 behind on Gemma; at 30 free pages flat LOCKS is 0.4 and 1.2 behind, so there
# the re-rank's reads buy nothing measurable. Below 30 the re-rank adds the keys of 4 (k - 2) < 120
# pages a step: about 3 % of the bytes at 128K-1M, where the summaries dominate; at short contexts it
# can double them (the demo at 4K: 12.3 % -> 24.1 % of full attention's bytes).
RERANK_AUTO = "auto"
AUTO_RERANK_MULTIPLE = 4
AUTO_RERANK_BELOW_FREE_PAGES = 30


def auto_rerank(pages_per_step: int, sink_pages: int, recent_pages: int) -> int:
    """The candidate multiple ``LocksConfig.rerank="auto"`` resolves to: :data:`AUTO_RERANK_MULTIPLE`
    from 1 to :data:`AUTO_RERANK_BELOW_FREE_PAGES` - 1 free pages per step, else 0 (flat scoring)."""
    free = pages_per_step - sink_pages - recent_pages
    if free <= 0 or free >= AUTO_RERANK_BELOW_FREE_PAGES:  # no free slot: nothing to re-rank
        return 0
    return AUTO_RERANK_MULTIPLE


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    check_int("LocksConfig", name, value, low, high)


@dataclass(frozen=True, kw_only=True)
class LocksConfig(ConfigIO):
    """Configuration of LOCKS page summaries, scoring and selection.

    Parameters
    ----------
    page_size : int
        Tokens per page (S). Default 16, as in the paper and vLLM's GPU block size.
    rank : int
        Summary rank (R), 1 <= rank <= page_size. Default 8.
    budget : int
        Tokens attended per layer and KV head at one decode step, sink and recent pages
        included: k = budget / page_size pages. A multiple of page_size and at least
        ``(sink_pages + recent_pages)`` pages.
    sink_pages, recent_pages : int
        Pages always kept at the start (sink) and end (most recently written) of the sequence.
    basis_bits : int
        Basis precision: 4 or 8 (signed integers, per-column scales), 2 (for ablations), or 16
        (unquantized, stored as float16).
    coef_bits : int
        Coefficient and centroid precision: 8 (int8, per-row / one scale) or 16 (float16).
    combine : str
        GQA group rule: ``"mean_share"`` (Eq. 5, average of per-head page shares),
        ``"max_share"`` (largest per-head share) or ``"sum_mass"`` (sum of unnormalised masses).
    rerank : int or "auto"
        Two-stage selection: 0 (off: flat Eq. 4 scoring) or a candidate multiple ``c`` in 2..64.
        The summaries rank the pages, the top ``c * (k - sink_pages - recent_pages)`` are
        candidates, their exact per-page log-sum-exp is computed from their keys (no values), and
        the top pages by those exact masses are selected (:mod:`kvlocks.selection.rerank`).
        ``"auto"`` (the default) resolves, at construction, to the measured rule
        :func:`auto_rerank`: ``c = 4`` while fewer than 30 pages are free per step (budgets below
        512 tokens at 16-token pages), else 0. ``rerank_auto`` tells whether the value was chosen
        so; an explicit value always wins.
    rerank_min : int
        With ``rerank``: at least this many candidates (pages), >= 0 (default 0).
    rerank_scores : str
        With ``rerank``: what chooses the candidates. ``"summary"`` (default): Eq. 4 on the whole
        summaries; ``"centroid"``: each page's centroid alone, ``log n + scale q.mu`` for its n
        tokens (Eq. 4 at rank 0), which reads ``D + 2`` of a summary's bytes per page at int8 (the
        ``locks_centroid`` method).
    """

    page_size: int = 16
    rank: int = 8
    budget: int = 256
    sink_pages: int = 1
    recent_pages: int = 1
    basis_bits: int = 4
    coef_bits: int = 8
    combine: str = "mean_share"
    rerank: int | str = RERANK_AUTO
    rerank_min: int = 0
    rerank_scores: str = "summary"

    def __post_init__(self) -> None:
        _check_int("page_size", self.page_size, 2, 4096)
        _check_int("rank", self.rank, 1, self.page_size)
        _check_int("sink_pages", self.sink_pages, 0)
        _check_int("recent_pages", self.recent_pages, 1)
        _check_int("budget", self.budget, 1)
        if self.budget % self.page_size:
            raise ValueError(
                f"LocksConfig.budget={self.budget}: must be a multiple of page_size={self.page_size}"
            )
        forced = self.sink_pages + self.recent_pages
        if self.budget // self.page_size < max(forced, 2):
            raise ValueError(
                f"LocksConfig.budget={self.budget}: must cover at least {max(forced, 2)} pages "
                f"(sink_pages + recent_pages, and never fewer than 2), i.e. "
                f">= {max(forced, 2) * self.page_size} tokens at page_size={self.page_size}"
            )
        if self.basis_bits not in BASIS_BITS:
            raise ValueError(f"LocksConfig.basis_bits={self.basis_bits!r}: allowed {BASIS_BITS}")
        if self.coef_bits not in COEF_BITS:
            raise ValueError(f"LocksConfig.coef_bits={self.coef_bits!r}: allowed {COEF_BITS}")
        if self.combine not in COMBINE_RULES:
            raise ValueError(f"LocksConfig.combine={self.combine!r}: allowed {COMBINE_RULES}")
        auto = self.rerank == RERANK_AUTO
        if auto:
            if self.rerank_scores == "centroid":
                raise ValueError("LocksConfig.rerank_scores='centroid' chooses the exact re-rank's candidates from the "
                                 "page centroids: set rerank explicitly (an integer in 2..64; 16 in the "
                                 "locks_centroid method)")
            object.__setattr__(self, "rerank", auto_rerank(self.budget // self.page_size, self.sink_pages,
                                                           self.recent_pages))
        object.__setattr__(self, "_rerank_auto", auto)  # not a field: equality and JSON see the value
        if isinstance(self.rerank, bool) or not isinstance(self.rerank, int) or not (
                self.rerank == 0 or 2 <= self.rerank <= 64):
            raise ValueError(f"LocksConfig.rerank={self.rerank!r}: allowed 0 (off), an integer in 2..64 or "
                             f"{RERANK_AUTO!r} (the default rule)")
        _check_int("rerank_min", self.rerank_min, 0)
        if self.rerank_scores not in RERANK_SCORES:
            raise ValueError(f"LocksConfig.rerank_scores={self.rerank_scores!r}: allowed {RERANK_SCORES}")
        if self.rerank_scores == "centroid" and not self.rerank:
            raise ValueError("LocksConfig.rerank_scores='centroid' chooses candidates for the exact re-rank from the "
                             "page centroids: it needs rerank in 2..64 (got rerank=0)")

    @property
    def rerank_auto(self) -> bool:
        """Whether ``rerank`` was chosen by the default rule (:func:`auto_rerank`), not set."""
        return self._rerank_auto

    def replace(self, **changes):
        """A copy with some fields changed (validated again); a ``rerank`` chosen by the default
        rule is chosen again for the new fields unless ``changes`` sets it."""
        if self._rerank_auto and "rerank" not in changes:
            changes["rerank"] = RERANK_AUTO
        return super().replace(**changes)

    def selection(self) -> str:
        """The selection a step runs: ``"flat"``, ``"rerank"`` or ``"centroid"``."""
        if self.rerank:
            return "centroid" if self.rerank_scores == "centroid" else "rerank"
        return "flat"

    @property
    def pages_per_step(self) -> int:
        """k: pages attended per (layer, KV head) at one decode step."""
        return self.budget // self.page_size

    def rerank_candidates(self, full_pages: int) -> int:
        """Candidate pages the exact re-rank scores among ``full_pages`` (0 when it is off)."""
        if not self.rerank:
            return 0
        free = max(1, self.pages_per_step - self.sink_pages - self.recent_pages)
        return min(full_pages, max(self.rerank * free, self.rerank_min))


# The product's method names that stand for a LocksConfig mode of the ``locks`` selector: the
# fields each sets where a configuration leaves them at their defaults (:func:`method_config`).
# Centroid candidates: at least 256 pages, 16 per free slot (docs/locks.md: with k = 8 of 500
# pages at 8K tokens, 16 (k - 2) candidates miss needle pages the rank-8 summaries find).
METHOD_MODES = {
    "locks_flat": {"rerank": 0},
    "locks_rerank": {"rerank": 4},
    "locks_centroid": {"rerank": 16, "rerank_min": 256, "rerank_scores": "centroid"},
}


def in_mode(method: str, config: LocksConfig) -> bool:
    """Whether ``config`` runs the mode a :data:`METHOD_MODES` name stands for (True for other names)."""
    if method == "locks_flat":
        return config.rerank == 0
    if method == "locks_rerank":
        return config.rerank > 0
    if method == "locks_centroid":
        return config.rerank_scores == "centroid"
    return True


def method_config(method: str, config: LocksConfig | None = None) -> LocksConfig:
    """The configuration a method name runs: ``config`` (default ``LocksConfig()``) with the fields
    of ``METHOD_MODES[method]`` that it leaves at their defaults set; ``"locks"``: ``config`` as is
    (its ``rerank="auto"`` rule included); any other selector name (a baseline: Quest, the oracle,
    ...): ``config`` with a re-rank that the default rule chose turned off, so a baseline runs as
    published unless its configuration sets ``rerank``.

    The one place a method alias becomes configuration: callers that take a method name and
    settings (the CLI, the lab's evaluation) call it; ``LocksCache`` runs the config it is given.
    """
    config = LocksConfig() if config is None else config
    if method != "locks" and method not in METHOD_MODES:
        return config.replace(rerank=0) if config.rerank_auto and config.rerank else config
    fields = {f: v for f, v in METHOD_MODES.get(method, {}).items() if _at_default(config, f)}
    return config.replace(**fields) if fields else config


def _at_default(config: LocksConfig, name: str) -> bool:
    if name == "rerank":
        return config.rerank_auto
    return getattr(config, name) == LocksConfig.__dataclass_fields__[name].default


@dataclass(frozen=True)
class DenseLaunch:
    """One launch of the split-KV attention kernel (:func:`kvlocks.attention.triton.paged_decode`):
    pages per inner step, warps, pipeline stages, and the split count as a multiple of the default
    (about 4 programs per SM)."""

    ppi: int = 4
    num_warps: int = 4
    num_stages: int = 3
    split_factor: float = 1.0

    def __post_init__(self) -> None:
        for name, allowed in (("ppi", (1, 2, 4, 8, 16)), ("num_warps", (1, 2, 4, 8, 16))):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"DenseLaunch.{name}={value!r}: allowed {allowed}")
        check_int("DenseLaunch", "num_stages", self.num_stages, 1, 8)
        f = self.split_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 64.0:
            raise ValueError(f"DenseLaunch.split_factor={f!r}: must be a number in (0, 64]")

    def label(self) -> str:
        return f"ppi{self.ppi}_w{self.num_warps}_s{self.num_stages}_x{self.split_factor:g}"


# The dense attention's launches timed at a method's first decode step, the default first: no one
# launch is fastest everywhere (H200, GLM-4-9B layer at 1M: 8 pages per step and 8 warps 506 us
# against 597 us for 4 and 4, while the split count decides short contexts; docs/benchmarks.md).
# Every (ppi, warps, stages) is one Triton compile; split factors reuse it.
DENSE_LAUNCHES: tuple[DenseLaunch, ...] = tuple(
    DenseLaunch(ppi, warps, stages, f)
    for ppi, warps, stages in ((4, 4, 3), (8, 8, 2), (8, 4, 2), (4, 8, 2))
    for f in (1.0, 2.0, 0.5, 0.25)
)
SCORE_KERNELS = ("auto", "cuda", "packed", "mma")
BUILD_SOLVERS = ("auto", "lean", "onesided")


def _pdl_default() -> bool:
    return env.flag("KVLOCKS_PDL")


@dataclass(frozen=True, kw_only=True)
class KernelOptions(ConfigIO):
    """How the decode kernels are launched: the settings that remain choices after measurement.
    Passed explicitly at plan time (``EngineConfig.kernels``, ``DecodePlan(options=...)``, the
    ``options=`` of :mod:`kvlocks.plan`'s functions); None there means ``KernelOptions()``.

    Parameters
    ----------
    pdl : programmatic dependent launch where the GPU supports it (compute capability >= 9.0, a
        Triton with the grid-dependency intrinsics; ignored elsewhere): the score kernel, the fused
        selection, the attention and its merge, and Inductor's kernels of the compiled step pieces.
        Same outputs either way. Default: ``KVLOCKS_PDL`` (on unless it is ``0``)
    compile_mode_max_batch : with ``EngineConfig.compile`` on a GPU, batches up to this size compile
        the step's pieces in Inductor's max-autotune mode, larger ones in the default mode (0: never)
    dense_launches : split-KV attention launches the tuner times (``EngineConfig.tune_attention``);
        the first is the launch used untuned and the reference every other one is checked against
    score_kernel : ``"auto"`` (the CUDA kernel where it runs, else the packed Triton kernel where
        it runs, else the three-dot Triton kernel: :func:`kvlocks.kernels_support.score_kernel`) or
        one of ``"cuda"``, ``"packed"``, ``"mma"`` (ValueError where it cannot run)
    build_solver : the summary build's eigensolver, ``"auto"`` (``"onesided"`` with Triton >= 3.9,
        ``"lean"`` before), ``"lean"`` or ``"onesided"``; both give the reference's summaries
    short_row_pages : rows of at most this many full pages get a fused-selection launch of their own,
        sized for rows that long (:func:`kvlocks.selection.fused.fused_workspace`), in plans wider
        than that; 0 (the default): one launch for every row. Same pages either way
    batch_invariant : size the score and attention launches for a batch of one whatever the batch,
        so a row's log-sum-exp and attention output are reduced over the same page splits, and so
        are the same bits, whichever rows share its step (more programs at large batches). The
        vLLM plugin turns it on under vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``)
    """

    pdl: bool = field(default_factory=_pdl_default)
    compile_mode_max_batch: int = 1
    dense_launches: tuple[DenseLaunch, ...] = DENSE_LAUNCHES
    score_kernel: str = "auto"
    build_solver: str = "auto"
    short_row_pages: int = 0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        for name in ("pdl", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelOptions.{name}={getattr(self, name)!r}: allowed True or False")
        check_int("KernelOptions", "compile_mode_max_batch", self.compile_mode_max_batch, 0, 4096)
        launches = self.dense_launches
        if not isinstance(launches, (tuple, list)) or not launches:
            raise ValueError(f"KernelOptions.dense_launches={launches!r}: need a non-empty tuple of DenseLaunch")
        launches = tuple(DenseLaunch(**x) if isinstance(x, dict) else x for x in launches)  # from_json
        for x in launches:
            if not isinstance(x, DenseLaunch):
                raise ValueError(f"KernelOptions.dense_launches: {x!r} is not a DenseLaunch")
        object.__setattr__(self, "dense_launches", launches)
        if self.score_kernel not in SCORE_KERNELS:
            raise ValueError(f"KernelOptions.score_kernel={self.score_kernel!r}: allowed {SCORE_KERNELS}")
        if self.build_solver not in BUILD_SOLVERS:
            raise ValueError(f"KernelOptions.build_solver={self.build_solver!r}: allowed {BUILD_SOLVERS}")
        check_int("KernelOptions", "short_row_pages", self.short_row_pages, 0, 1 << 24)


def default_kernel_options() -> KernelOptions:
    """``KernelOptions()``, made once per value of ``KVLOCKS_PDL`` (what ``options=None`` means in the
    kernels' entry points, called per layer: no validation on the hot path)."""
    return _default_options(env.get("KVLOCKS_PDL"))


@lru_cache(maxsize=8)
def _default_options(_pdl_env: str | None) -> KernelOptions:
    return KernelOptions()
