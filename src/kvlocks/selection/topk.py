"""Sink + recent + top-(k - forced) page selection with deterministic tie-breaking."""

from __future__ import annotations

import torch


def select_top_pages(
    ranking: torch.Tensor,
    total_pages: int,
    k: int,
    *,
    sink_pages: int = 1,
    recent_pages: int = 1,
    sink_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose ``K = min(k, total_pages)`` pages per row, returned in ascending order.

    Parameters
    ----------
    ranking : float ``[..., Pc]``
        Combined score of each *candidate* page (the full, summarised pages ``0 .. Pc-1``);
        higher is better, ``-inf`` means "never by score" (e.g. a page of padding only).
    total_pages : int
        All pages of the sequence, ``Pc`` or ``Pc + 1`` when a partial last page exists (that
        page has no summary and is always kept as the recent page).
    k : int
        Pages attended per step, sink and recent included.
    sink_pages, recent_pages : int
        Pages always kept: ``sink_pages`` from ``sink_start`` (default page 0) and the last
        ``recent_pages`` pages.
    sink_start : int64 ``[...]``, optional
        First page holding a real token, per row (left padding moves the sink).

    Returns
    -------
    int64 ``[..., K]``, ascending page ids. Remaining slots go to the highest-ranked pages; ties
    go to the lower page index, so the result is deterministic.
    """
    pc = ranking.shape[-1]
    if total_pages not in (pc, pc + 1):
        raise ValueError(f"total_pages={total_pages} must be the candidate count {pc} or {pc + 1}")
    kk = min(k, total_pages)
    lead = ranking.shape[:-1]
    prio = torch.full((*lead, total_pages), float("-inf"), dtype=torch.float32, device=ranking.device)
    prio[..., :pc] = ranking.float()
    pages = torch.arange(total_pages, device=ranking.device)
    forced = pages >= total_pages - recent_pages  # [P]
    if sink_pages:
        start = torch.zeros(lead, dtype=torch.long, device=ranking.device) if sink_start is None else sink_start
        start = start.unsqueeze(-1)
        forced = forced | ((pages >= start) & (pages < start + sink_pages))  # [..., P]
    prio = torch.where(forced, torch.full_like(prio, float("inf")), prio)
    # stable descending sort: equal priorities keep ascending page order (lower index wins)
    order = torch.sort(prio, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :kk], dim=-1).values
