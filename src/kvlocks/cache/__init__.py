"""Paged K/V storage with incrementally built page summaries."""

from kvlocks.cache.paged import PagedLayerStore

__all__ = ["PagedLayerStore"]
