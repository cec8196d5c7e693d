"""Matched-bytes settings: baselines given the same summary bytes per page as LOCKS.

A fair selector comparison spends the same resident bytes on each page's summary. For a
:class:`~kvlocks.config.LocksConfig` and ``head_dim`` D, LOCKS reads per page and KV head
(see :meth:`kvlocks.summary.types.PageSummaries.bytes_per_page`)::

    D * R * basis_bits / 8 + S * R * coef_bits / 8 + D * coef_bits / 8   (payload)
    + 2 * R (basis scales, unless 16-bit) + 2 * (S + 1) (coef/centroid scales, unless 16-bit)

e.g. 768 + 50 = 818 bytes at D=128, S=16, R=8, int4 basis, int8 coefficients.

Each baseline is matched at a fixed precision by its size knob: the largest value whose bytes per
page do not exceed LOCKS's, so ``bytes(x) <= LOCKS < bytes(x + 1)`` (never below 1, never above
the knob's maximum):

==========  ==============  ======================================  =============
selector    knob            bytes per page (payload + scales)       default bits
==========  ==============  ======================================  =============
quest       sub_pages M<=S  M * 2 * D * b (+ 2 M at int8)           16
centroid    sub_pages M<=S  M * D * b (+ 2 M at int8)               16
loki        rank r<=D       S * r * b (+ 2 S at int8)               16
shadowkv    rank r<=D       S * r * b + D * b (+ 2 (S+1) at int8)   8
==========  ==============  ======================================  =============

with ``b = bits / 8``. Loki and ShadowKV also read one shared ``[D, r]`` float16 basis per KV
head and step; it does not grow with the context, so it is left out of the per-page match (their
``selection_bytes`` counts it).

The byte formulas of each baseline live here, so the selectors and the matching both read them
from one module; :func:`kvlocks.selection.selectors.matched_selector` builds a matched instance.
"""

from __future__ import annotations

from collections.abc import Callable

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import check_bits, scale_bytes


def envelope_bytes(head_dim: int, sub_pages: int, bits: int | None, elem_size: int = 2) -> tuple[int, int]:
    """Quest: ``(payload, scales)`` per page: ``sub_pages`` min/max pairs of ``head_dim`` values."""
    width = elem_size if bits is None else bits // 8
    return sub_pages * 2 * head_dim * width, (2 * sub_pages if bits == 8 else 0)


def centroid_bytes(head_dim: int, sub_pages: int, bits: int | None, elem_size: int = 2) -> tuple[int, int]:
    """Centroid: ``(payload, scales)`` per page: ``sub_pages`` centroids of ``head_dim`` values."""
    width = elem_size if bits is None else bits // 8
    return sub_pages * head_dim * width, (2 * sub_pages if bits == 8 else 0)


def loki_bytes(page_size: int, rank: int, bits: int) -> tuple[int, int]:
    """Loki: ``(payload, scales)`` per page: the first ``r`` rotated dims of ``S`` keys at ``bits``."""
    return page_size * rank * (bits // 8), scale_bytes(bits, page_size)


def shadowkv_bytes(head_dim: int, page_size: int, rank: int, bits: int) -> tuple[int, int]:
    """ShadowKV: ``(payload, scales)`` per page: ``S * r`` coefficients and one centroid at ``bits``."""
    w = bits // 8
    return page_size * rank * w + head_dim * w, scale_bytes(bits, page_size + 1)


def locks_page_bytes(config: LocksConfig, head_dim: int) -> int:
    """Bytes (payload + scales) of one LOCKS page summary for one KV head."""
    s, r, d = config.page_size, config.rank, head_dim
    payload = (d * r * config.basis_bits) // 8 + (s * r * config.coef_bits) // 8 + (d * config.coef_bits) // 8
    scales = (2 * r if config.basis_bits != 16 else 0) + (2 * (s + 1) if config.coef_bits != 16 else 0)
    return payload + scales


def largest_within(bytes_of: Callable[[int], int], budget: int, high: int) -> int:
    """Largest ``x`` in ``[1, high]`` with ``bytes_of(x) <= budget`` (1 if none fits).

    ``bytes_of`` must be non-decreasing.
    """
    best = 1
    for x in range(1, high + 1):
        if bytes_of(x) > budget:
            break
        best = x
    return best


def _check(name: str, bits: int, allowed: tuple[int, ...]) -> None:
    check_bits(f"matched_{name}", bits, allowed)


def matched_quest(config: LocksConfig, head_dim: int, *, bits: int = 16) -> dict:
    """Quest settings ``{"bits", "sub_pages"}`` with envelope bytes per page matched to LOCKS."""
    _check("quest", bits, (8, 16, 32))
    fit = largest_within(lambda m: sum(envelope_bytes(head_dim, m, bits)), locks_page_bytes(config, head_dim),
                         config.page_size)
    return {"bits": bits, "sub_pages": fit}


def matched_centroid(config: LocksConfig, head_dim: int, *, bits: int = 16) -> dict:
    """Centroid settings ``{"bits", "sub_pages"}`` with centroid bytes per page matched to LOCKS."""
    _check("centroid", bits, (8, 16, 32))
    fit = largest_within(lambda m: sum(centroid_bytes(head_dim, m, bits)), locks_page_bytes(config, head_dim),
                         config.page_size)
    return {"bits": bits, "sub_pages": fit}


def matched_loki(config: LocksConfig, head_dim: int, *, bits: int = 16) -> dict:
    """Loki settings ``{"bits", "rank"}`` with projected-key bytes per page matched to LOCKS."""
    _check("loki", bits, (8, 16, 32))
    fit = largest_within(lambda r: sum(loki_bytes(config.page_size, r, bits)), locks_page_bytes(config, head_dim),
                         head_dim)
    return {"bits": bits, "rank": fit}


def matched_shadowkv(config: LocksConfig, head_dim: int, *, bits: int = 8) -> dict:
    """ShadowKV settings ``{"bits", "rank"}`` with summary bytes per page matched to LOCKS."""
    _check("shadowkv", bits, (8, 16, 32))
    fit = largest_within(lambda r: sum(shadowkv_bytes(head_dim, config.page_size, r, bits)),
                         locks_page_bytes(config, head_dim), head_dim)
    return {"bits": bits, "rank": fit}


MATCHED = {"quest": matched_quest, "centroid": matched_centroid, "loki": matched_loki, "shadowkv": matched_shadowkv}


def matched_settings(name: str, config: LocksConfig, head_dim: int, **kwargs) -> dict:
    """Keyword settings of selector ``name`` at LOCKS's bytes per page (``kwargs``: e.g. ``bits``)."""
    if name not in MATCHED:
        raise ValueError(f"matched_settings: name={name!r}; allowed {sorted(MATCHED)}")
    return MATCHED[name](config, head_dim, **kwargs)
