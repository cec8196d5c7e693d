"""The paged ``locks_centroid`` step (``LocksConfig.rerank_scores = "centroid"``): the Triton centroid
score kernel (kvlocks.scoring.triton_centroid) against a float64 reference from the stored int8
centroids (``log S + scale q.mu``), and the decode plan's whole step (scores, candidate selection,
exact re-rank, attention; Triton and torch backends) against the token-major ``locks_centroid``
selector with the re-rank, row by row, and exact attention over the pages it chose. The Triton
kernels run in the interpreter on the CPU."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlocks.cache.layout import SummaryStore, paged_to_token_major  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build  # noqa: E402
from kvlocks.scoring.triton_centroid import score_pages_centroid  # noqa: E402
from kvlocks.selection.selectors import LayerView, choose_pages  # noqa: E402
from kvlocks_lab.selectors.locks_centroid import LocksCentroidSelector  # noqa: E402

S = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def centroid_reference(queries, summaries, block_table, seq_lens, *, scale=None):
    """Float64 scores ``[B, Hkv, G, W]`` from the stored centroids, -inf past each row's full pages."""
    bsz, hq, d = queries.shape
    hkv, s = summaries.num_kv_heads, summaries.page_size
    g, w = hq // hkv, block_table.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    out = torch.full((bsz, hkv, g, w), float("-inf"), dtype=torch.float64)
    for b in range(bsz):
        pc = int(seq_lens[b]) // s
        ids = block_table[b, :pc].long().cpu()
        mu = summaries.centroid.cpu()[ids].double() * summaries.centroid_scale.cpu()[ids].double()[..., None]
        q = queries[b].cpu().double().view(hkv, g, d)
        out[b, :, :, :pc] = math.log(s) + scale * torch.einsum("hgd,phd->hgp", q, mu)
    return out


def _case(lens, hkv, g, d, cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, p in enumerate(need):
        table[b, :p] = perm[at: at + p].to(torch.int32)
        at += p
    k = torch.randn(nb, S, hkv, d, generator=gen) + torch.randn(nb, 1, hkv, d, generator=gen)  # pages differ
    v = torch.randn(nb, S, hkv, d, generator=gen)
    q = torch.randn(len(lens), hkv * g, d, generator=gen) * 2
    store = SummaryStore.empty(nb, hkv, d, cfg, device="cpu")
    full = torch.cat([table[b, : n // S] for b, n in enumerate(lens)])
    paged_build(k, store, full, cfg, backend="torch")
    to = dict(device=DEV)
    return (q.to(**to), k.to(**to), v.to(**to), table.to(**to), torch.tensor(lens, dtype=torch.int32, **to),
            store.to(DEV))


@pytest.mark.parametrize("g,dtype", [(1, torch.float32), (3, torch.float32), (4, torch.bfloat16),
                                     (8, torch.bfloat16)])
def test_centroid_scores_and_lse_match_the_float64_reference(g, dtype):
    """Rows of 1 to 150 full pages (a partial last page, a row with one page, more pages than one
    program step of 64): per-head scores and each head's log-sum-exp over its full pages."""
    hkv, d = 2, 64
    cfg = LocksConfig(budget=64)
    lens = [150 * S + 9, 23 * S + 5, S + 3, 70 * S]
    q, k, v, table, seq, store = _case(lens, hkv, g, d, cfg, seed=g)
    q = q.to(dtype)
    scores, lse, _ = score_pages_centroid(q, store, table, seq)
    want = centroid_reference(q, store, table, seq)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    for b, n in enumerate(lens):
        pc = n // S
        got = scores[b, :, :, :pc].double().cpu()
        torch.testing.assert_close(got, want[b, :, :, :pc], rtol=tol, atol=tol * 10)
        torch.testing.assert_close(lse[b].double().cpu(), torch.logsumexp(want[b, :, :, :pc], -1), rtol=tol,
                                   atol=tol * 10)


def test_centroid_kernel_refuses_what_it_cannot_score():
    hkv, d = 2, 64
    q, k, v, table, seq, store = _case([4 * S], hkv, 2, d, LocksConfig(budget=64))
    with pytest.raises(ValueError, match="do not fit summaries"):
        score_pages_centroid(q[:, :3], store, table, seq)
    with pytest.raises(ValueError, match="do not fit summaries"):
        score_pages_centroid(q[..., :32], store, table, seq)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("g,rule,mult,floor", [(3, "mean_share", 4, 1), (4, "max_share", 2, 12),
                                               (1, "sum_mass", 16, 1)])
def test_plan_selects_the_token_major_locks_centroid_pages_and_attends_them_exactly(g, rule, mult, floor, backend):
    """k = 4 pages (2 free slots), ``max(mult * 2, floor)`` candidates from the centroids, the exact re-rank:
    the plan's pages equal ``choose_pages`` with the ``locks_centroid`` selector on each row
    (summaries read back from the store), and its output is exact softmax attention over those
    pages' tokens (float64 reference)."""
    hkv, d = 2, 64
    cfg = LocksConfig(budget=64, rerank=mult, rerank_min=floor, combine=rule, rerank_scores="centroid")
    lens = [40 * S, 23 * S + 5, 3 * S + 1, 9 * S]
    q, k, v, table, seq, store = _case(lens, hkv, g, d, cfg, seed=10 + g)
    plan = DecodePlan(batch=len(lens), num_kv_heads=hkv, group=g, head_dim=d, max_pages=table.shape[1],
                      config=cfg, dtype=torch.float32, device=DEV, backend=backend)
    out, _ = plan.run(q, k, v, store, table, seq)
    sel = LocksCentroidSelector()
    for b, n in enumerate(lens):
        keys = paged_to_token_major(k.cpu(), table[b].cpu(), n)  # [Hkv, n, D]
        vals = paged_to_token_major(v.cpu(), table[b].cpu(), n)
        view = LayerView(keys=keys, summaries=store.to("cpu").gather(table[b, : n // S].cpu()), token_mask=None,
                         scale=d ** -0.5)
        want = choose_pages(q[b].cpu().view(hkv, g, d), view, cfg, sel)  # [Hkv, K]
        got = plan.pages[b, :, : want.shape[-1]].cpu()
        assert got.tolist() == want.tolist(), (b, n)
        for h in range(hkv):
            pages = [p for p in want[h].tolist() if p >= 0]
            idx = torch.cat([torch.arange(p * S, min(n, (p + 1) * S)) for p in pages])
            qh = q[b].cpu().double().view(hkv, g, d)[h]  # [G, D]
            w = torch.softmax(qh @ keys[h, idx].double().T * d ** -0.5, dim=-1)
            ref = w @ vals[h, idx].double()
            torch.testing.assert_close(out[b].cpu().double().view(hkv, g, d)[h], ref, rtol=1e-4, atol=1e-4)
