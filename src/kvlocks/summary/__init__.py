"""Per-page LOCKS summaries: build, quantize, byte accounting."""

from kvlocks.summary.build import build_summaries, spectral_basis
from kvlocks.summary.types import PageSummaries

__all__ = ["PageSummaries", "build_summaries", "spectral_basis"]
