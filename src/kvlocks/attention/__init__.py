"""Decode-time attention: over selected pages (LOCKS) and dense (FullKV reference)."""

from kvlocks.attention.reference import dense_decode, sparse_decode

__all__ = ["dense_decode", "sparse_decode"]
