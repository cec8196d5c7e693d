"""Validated, frozen configuration for LOCKS sparse decode.

Every field is keyword-only; invalid values raise ``ValueError`` naming the field, the value
and what is allowed, so a typo never turns into a silently different experiment.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlocks._config_io import ConfigIO, check_int

COMBINE_RULES = ("mean_share", "max_share", "sum_mass")
BASIS_BITS = (2, 4, 8, 16)
COEF_BITS = (8, 16)


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
    """

    page_size: int = 16
    rank: int = 8
    budget: int = 256
    sink_pages: int = 1
    recent_pages: int = 1
    basis_bits: int = 4
    coef_bits: int = 8
    combine: str = "mean_share"

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

    @property
    def pages_per_step(self) -> int:
        """k: pages attended per (layer, KV head) at one decode step."""
        return self.budget // self.page_size
