"""Sink + recent + top-(k - forced) selection for a batch of rows of different lengths, in one
sort: the rule of :func:`kvlocks.selection.topk.select_top_pages` (same pages, same ties) with a
page count per row, for the decode plan's ``cpu`` backend."""

from __future__ import annotations

import torch


def select_rows(ranking: torch.Tensor, full_pages: torch.Tensor, total_pages: torch.Tensor, k: int, *,
                sink_pages: int, recent_pages: int) -> torch.Tensor:
    """int32 ``[R, k]`` ascending logical page ids per row, -1 padded (rows with fewer than k pages).

    Parameters
    ----------
    ranking : float ``[R, W]``, the combined score of each page; entries at and past a row's
        ``full_pages`` are not read
    full_pages, total_pages : int64 ``[R]``: ``Pc`` and ``ceil(n / S)`` of each row (``total - Pc``
        is 0 or 1: the partial last page, kept as a recent page)
    k : pages per row; sink_pages, recent_pages : always kept (the first and the last pages)
    """
    rows, width = ranking.shape
    span = max(width, int(total_pages.max()) if rows else 0)
    page = torch.arange(span, device=ranking.device)  # [W']
    prio = torch.full((rows, span), float("-inf"), device=ranking.device)
    prio[:, :width] = ranking.float()
    prio = prio.masked_fill(page >= full_pages[:, None], float("-inf"))
    total = total_pages[:, None]
    forced = ((page >= total - recent_pages) | (page < sink_pages)) & (page < total)  # [R, W']
    prio = prio.masked_fill(forced, float("inf"))
    order = torch.sort(prio, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: the lower page
    ids = torch.sort(order, dim=-1).values
    ids = ids.masked_fill(ids >= total, -1)  # past a row's pages: padding, at the end after the sort
    if ids.shape[1] < k:
        ids = torch.cat([ids, ids.new_full((rows, k - ids.shape[1]), -1)], dim=1)
    return ids.to(torch.int32)
