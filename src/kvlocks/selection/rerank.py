"""Two-stage selection: the summaries choose candidate pages, their exact masses choose the pages.

LOCKS ranks every full page by its summary estimate (Eq. 4). At tight budgets a page that carries
the attention mass can rank just below the cut (rank truncation and quantisation move estimates
by a few tenths of a logit). With ``LocksConfig.rerank = c`` the top ``M = c * (k - sink -
recent)`` pages of the summary ranking (sink and recent pages excluded: they are kept anyway) are
candidates. For the candidates and the forced full pages the exact log-sum-exp of ``q.k * scale``
over each page's keys is computed (keys only, ``(M + sink + recent) * S * D`` values per KV head);
the per-head vector that is exact there and the summary estimate elsewhere goes through the
configured GQA combine, and only candidates stay eligible for the free slots. When the
candidates cover every eligible page the result is the exact oracle's selection.

Pure PyTorch, float32 math, any device: the reference the kernels are checked against.
:mod:`kvlocks.selection.rerank_paged` runs the same math over the paged cache.
"""

from __future__ import annotations

import torch

from kvlocks.config import METHOD_MODES, LocksConfig
from kvlocks.pages import full_pages
from kvlocks.scoring.reference import combine_group

NEG_INF = float("-inf")
RERANK_METHOD = "locks_rerank"  # the method name of LOCKS with the re-rank (LocksCache, the CLI, eval)
DEFAULT_RERANK = METHOD_MODES[RERANK_METHOD]["rerank"]  # its candidate multiple (kvlocks.config.method_config)


def candidates(pick: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[..., count]``: the ``count`` best pages of ``pick [..., P]``, best first (exactly
    tied estimates may come in any order; surplus ``-inf`` entries are not useful)."""
    return torch.topk(pick.float(), count, dim=-1).indices


def forced_pages(total_pages, config: LocksConfig, sink_start=None):
    """int64 ``[..., F]`` (F = sink_pages + recent_pages): the pages the selection keeps anyway.

    ``total_pages``: an int or an int64 tensor ``[...]``; ``sink_start``: int64 ``[...]`` or None
    (page 0). Ids may repeat (short sequences) or fall on the partial last page.
    """
    total = torch.as_tensor(total_pages)
    start = torch.zeros_like(total) if sink_start is None else sink_start.long()
    total, start = torch.broadcast_tensors(total, start)
    sink = start.unsqueeze(-1) + torch.arange(config.sink_pages, device=start.device)
    recent = total.unsqueeze(-1) - config.recent_pages + torch.arange(config.recent_pages, device=total.device)
    return torch.cat([sink, recent], dim=-1).clamp_min(0)


def _place(vec: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``vec [..., P]`` with ``val [..., N]`` written at ``idx [..., N]`` where ``ok``; the other
    entries go to a scratch column (indices written twice must carry equal values)."""
    p = vec.shape[-1]
    padded = torch.cat([vec, vec[..., :1]], dim=-1)
    return padded.scatter(-1, torch.where(ok, idx, p), val)[..., :p]


def merge_exact(scores: torch.Tensor, pick: torch.Tensor, cand: torch.Tensor, forced: torch.Tensor,
                forced_ok: torch.Tensor, exact: torch.Tensor, combine: str) -> torch.Tensor:
    """The final ranking ``[..., P]`` from the estimates and the exact masses.

    scores float32 ``[..., G, P]`` (estimates; ``-inf`` where a page has no real token), pick
    ``[..., P]`` (the ranking the candidates came from, ``-inf`` on forced and empty pages), cand
    int64 ``[..., M]``, forced int64 ``[..., F]`` with forced_ok bool ``[..., F]`` (a full page),
    exact float32 ``[..., G, M + F]`` (for ``cand`` then ``forced``). A candidate counts where its
    ``pick`` is finite, so surplus candidates change nothing.
    """
    g = scores.shape[-2]
    useful = torch.isfinite(pick.gather(-1, cand))  # [..., M]
    idx = torch.cat([cand, forced], dim=-1)  # [..., M + F]
    ok = torch.cat([useful, forced_ok], dim=-1)
    hybrid = _place(scores.float(), idx.unsqueeze(-2).expand(*idx.shape[:-1], g, idx.shape[-1]), exact,
                    ok.unsqueeze(-2).expand_as(exact))
    combined = combine_group(hybrid, combine)  # [..., P]
    combined = torch.where(torch.isneginf(hybrid).all(dim=-2), NEG_INF, combined)
    return _place(torch.full_like(combined, NEG_INF), cand, combined.gather(-1, cand), useful)


def candidate_lse(queries: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor, page_size: int, *,
                  scale: float, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact per-page log-sum-exp on some pages only.

    queries ``[..., G, D]``, keys ``[..., N, D]`` token-major, pages int64 ``[..., M]`` (ids past
    the full pages are read as page 0: mask them out), token_mask optional bool ``[..., N]`` ->
    float32 ``[..., G, M]``.
    """
    d, n = keys.shape[-1], keys.shape[-2]
    pages = torch.where(pages < full_pages(n, page_size), pages, 0)
    tok = (pages.unsqueeze(-1) * page_size + torch.arange(page_size, device=keys.device)).flatten(-2)  # [..., M*S]
    k = torch.gather(keys, -2, tok.unsqueeze(-1).expand(*tok.shape, d)).float()
    k = k.unflatten(-2, (pages.shape[-1], page_size))  # [..., M, S, D]
    logits = torch.einsum("...gd,...msd->...gms", queries.float(), k) * scale  # [..., G, M, S]
    if token_mask is not None:
        real = torch.gather(token_mask, -1, tok).unflatten(-1, (pages.shape[-1], page_size))  # [..., M, S]
        logits = logits.masked_fill(~real.unsqueeze(-3), NEG_INF)
    return torch.logsumexp(logits, dim=-1)


def rerank_ranking(queries: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor, ranking: torch.Tensor,
                   config: LocksConfig, *, scale: float, total_pages: int, token_mask: torch.Tensor | None = None,
                   sink_start: torch.Tensor | None = None) -> torch.Tensor:
    """The ranking ``[..., Pc]`` the final selection uses after the exact re-rank (``-inf`` outside
    the candidates; sink and recent pages are kept by the selection regardless).

    queries ``[..., G, D]``, keys ``[..., N, D]``, scores float32 ``[..., G, Pc]`` (the summary
    estimates), ranking ``[..., Pc]`` (their combine), total_pages: ``Pc`` or ``Pc + 1``,
    sink_start int64 ``[...]`` as in :func:`~kvlocks.selection.topk.select_top_pages`. With
    ``config.rerank == 0`` the ranking is returned unchanged.
    """
    pc = scores.shape[-1]
    m = config.rerank_candidates(pc)
    if m == 0:
        return ranking
    forced = forced_pages(total_pages, config, sink_start).to(ranking.device)  # [F] or [..., F]
    forced = forced.expand(*ranking.shape[:-1], forced.shape[-1])
    pick, cand = pick_candidates(ranking, forced, m)
    exact = candidate_lse(queries, keys, torch.cat([cand, forced], dim=-1), config.page_size, scale=scale,
                          token_mask=token_mask)
    return merge_exact(scores, pick, cand, forced, forced < pc, exact, config.combine)


def pick_candidates(ranking: torch.Tensor, forced: torch.Tensor, count: int):
    """``(pick [..., P], cand int64 [..., count])``: the ranking with the forced pages ``[..., F]``
    removed (``-inf``), and its ``count`` best pages."""
    p = ranking.shape[-1]
    is_forced = _place(torch.zeros_like(ranking, dtype=torch.bool), forced, torch.ones_like(forced, dtype=torch.bool),
                       forced < p)
    pick = torch.where(is_forced, NEG_INF, ranking.float())
    return pick, candidates(pick, count)
