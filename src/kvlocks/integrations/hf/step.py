"""The Hugging Face cache's decode step on the decode plan (:class:`kvlocks.plan.DecodePlan`).

A layer store keeps K/V in page-aligned buffers ``[B, Hkv, cap, D]``; viewed as a paged cache
``[B * Hkv * cap / S, S, 1, D]`` with the block table ``[B * Hkv, cap / S]`` (row ``b * Hkv + h``
is one sequence with one KV head) the plan runs on it unchanged, without a copy. The summaries:
the ``cpu`` backend reads the layer's dequantized :class:`~kvlocks.scoring.cpu.ScoringBuffers`;
the ``triton`` backend reads the summaries ``[B, Hkv, P]`` viewed as a
:class:`~kvlocks.summary.store.SummaryStore` of ``B * Hkv * P`` one-head pages, numbered apart
from the K/V pages (``summary_table``). The ``locks`` selector runs the whole plan (every mode:
flat, ``config.rerank``, ``rerank_scores="centroid"``); other selectors score the pages their own
way (:func:`~kvlocks.selection.selectors.rank_pages`) and the plan selects and attends
(:meth:`~kvlocks.plan.DecodePlan.run_ranked`).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.kernels_support import kernel_support
from kvlocks.pages import full_pages, num_pages
from kvlocks.plan import DecodePlan
from kvlocks.selection.selectors import LayerView, LocksSelector, rank_pages
from kvlocks.summary.store import SummaryStore
from kvlocks.summary.types import PageSummaries

NEG_INF = float("-inf")


def plan_backend(backend: str | None, selector, config: LocksConfig, head_dim: int, device) -> str | None:
    """The plan backend of a decode step over keys of ``head_dim`` on ``device``, or None for the
    token-major references (``backend="torch"``, a per-head selector).

    ``backend`` None: ``"triton"`` for CUDA keys with a configuration the kernels support
    (:func:`kvlocks.kernels_support.kernel_support`), else ``"cpu"`` (batched PyTorch, any device)."""
    if backend == "torch" or getattr(selector, "per_head", False):
        return None
    if backend is not None:
        return backend
    if torch.device(device).type == "cuda" and kernel_support(
            page_size=config.page_size, rank=config.rank, head_dim=head_dim, basis_bits=config.basis_bits,
            coef_bits=config.coef_bits, backend="triton") is None:
        return "triton"
    return "cpu"


class StepPlans:
    """One :class:`DecodePlan` per (backend, rows, G, D, table width, dtype, device, scale): the
    layers of a step share it; the table width is the store's capacity in pages (it doubles)."""

    def __init__(self, config: LocksConfig, options=None) -> None:
        self.config, self.options = config, options
        self.plans: dict = {}
        self.tables: dict = {}

    def get(self, backend: str, rows: int, group: int, head_dim: int, width: int, dtype, device, scale: float):
        key = (backend, rows, group, head_dim, width, dtype, str(device), scale)
        if key not in self.plans:
            self.plans[key] = DecodePlan(batch=rows, num_kv_heads=1, group=group, head_dim=head_dim, max_pages=width,
                                         config=self.config, dtype=dtype, device=device, scale=scale,
                                         backend=backend, options=self.options)
        return self.plans[key]

    def table(self, rows: int, width: int, device) -> torch.Tensor:
        """int32 ``[rows, width]``: row ``r`` owns pages ``r * width .. r * width + width - 1``."""
        key = (rows, width, str(device))
        if key not in self.tables:
            self.tables[key] = torch.arange(rows * width, device=device, dtype=torch.int32).view(rows, width)
        return self.tables[key]


def summary_view(summaries: PageSummaries, width: int) -> tuple[SummaryStore, torch.Tensor]:
    """``summaries`` (leading dims ``[B, Hkv]``, P pages, int4/int8) as a store of ``B * Hkv * P``
    one-head pages and its table int32 ``[B * Hkv, width]`` (entries past P repeat page P - 1)."""
    b, hkv = summaries.lead_shape
    rows, p = b * hkv, summaries.num_pages

    def one_head(t):  # [B, Hkv, P, ...] -> [B * Hkv * P, 1, ...]
        return t.reshape(rows * p, 1, *t.shape[3:])

    store = SummaryStore(one_head(summaries.basis), one_head(summaries.basis_scale), one_head(summaries.coef),
                         one_head(summaries.coef_scale), one_head(summaries.centroid),
                         one_head(summaries.centroid_scale))
    dev = summaries.coef.device
    pages = torch.arange(width, device=dev).clamp_max(p - 1)
    table = (torch.arange(rows, device=dev)[:, None] * p + pages).to(torch.int32)  # [rows, width]
    return store, table


def plan_decode(layer, q: torch.Tensor, key: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
    """One layer's decode step on the plan: q ``[B, Hkv, G, D]``, key ``[B, Hkv, N, D]`` (the store's
    view) -> ``[B, Hkv, G, D]``; records the pages read."""
    owner, store, cfg = layer.owner, layer.store, layer.owner.config
    b, hkv, g, d = q.shape
    s, n, rows = cfg.page_size, key.shape[2], b * hkv
    kc, vc, width = store.paged_view()  # [B*Hkv*width, S, 1, D], width page slots per row
    table = owner.plans.table(rows, width, q.device)
    seq = torch.full((rows,), n, dtype=torch.int32, device=q.device)
    plan = owner.plans.get(backend, rows, g, d, width, q.dtype, q.device, scale)
    qr = q.reshape(rows, g, d)
    pc, total = full_pages(n, s), num_pages(n, s)
    selector = owner.selector
    if total <= cfg.pages_per_step:  # every page is read: nothing to score
        out, _ = plan.run_ranked(qr, kc, vc, table, seq, q.new_zeros((rows, 1, width), dtype=torch.float32))
    elif type(selector) is LocksSelector:
        if backend == "cpu":
            store.scoring.sync(store.summaries)
            out, _ = plan.run(qr, kc, vc, store.scoring, table, seq)
        else:
            summ, stable = summary_view(store.summaries, width)
            out, _ = plan.run(qr, kc, vc, summ, table, seq, summary_table=stable)
    else:  # the selector's own scores; the plan selects (and re-ranks) and attends
        view = LayerView(keys=key, summaries=store.summaries, token_mask=None, scale=scale, layer=layer.layer_idx)
        ranking, scores = rank_pages(q, view, cfg, selector)  # [B, Hkv, Pc], [B, Hkv, G, Pc] or None
        ranking = _widen(ranking.reshape(rows, 1, pc), width)
        scores = None if scores is None else _widen(scores.reshape(rows, 1, g, pc), width)
        out, _ = plan.run_ranked(qr, kc, vc, table, seq, ranking, scores=scores)
    owner.record(layer.layer_idx, key, min(cfg.pages_per_step, total))
    return out.view(b, hkv, g, d)


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [..., Pc]`` float32, ``-inf`` padded to ``[..., width]``."""
    out = x.new_full((*x.shape[:-1], width), NEG_INF, dtype=torch.float32)
    out[..., : x.shape[-1]] = x
    return out
