"""The decode kernels at head_dim 256 (Gemma 3's global layers) against the PyTorch references.

Same checks as ``tests/test_kernels.py`` (whose helpers this module uses), at D = 256 and the GQA
shapes of Gemma 3: 270M has 4 query heads on 1 KV head (Hkv = 1, G = 4), 12B 16 on 8 (G = 2); G 1
and 8 for the edges. Token counts 1, 15, 16, 17, 33, 100, 130 and a few thousand on the CPU (the
Triton interpreter), up to 262,144 on a GPU; budgets of only the forced pages, small, and at
least every page. The CUDA score kernel does not take D = 256 (``kernels_support.CUDA_HEAD_DIMS``):
the score kernel choice routes it to the packed Triton kernel on CUDA.
"""

import math

import pytest
import torch

import test_kernels as tk  # noqa: I001 (sets TRITON_INTERPRET before any kernel module is imported)
from test_kernels import BF16, CUDA, DEV, F16, F32, LENS, S, _assert_scores_match, built_store, make_paged

from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.kernels_support import kernel_support, score_kernel
from kvlocks.plan import DecodePlan, paged_build_new, paged_score
from kvlocks.cache.layout import SummaryStore
from kvlocks.scoring import triton as score_tri

D = 256
MMA = KernelOptions(score_kernel="mma")


@pytest.mark.parametrize("lens,hkv,g,dtype,rule", [
    ("a", 1, 4, F32, "mean_share"), ("b", 8 if CUDA else 2, 2, BF16, "max_share"), ("c", 1, 1, F16, "sum_mass"),
    ("d", 2, 8, BF16, "mean_share"), ("e", 1, 4, BF16, "mean_share"),
])
def test_three_dot_score_kernel_at_256(lens, hkv, g, dtype, rule):
    q, k, _, table, seq = make_paged(LENS[lens], hkv, g, D, dtype)
    store = built_store(k, table, seq, LocksConfig(combine=rule))
    got = score_tri.score_pages_paged(q, store, table, seq, combine=rule, options=MMA)
    _assert_scores_match(got, paged_score(q, store, table, seq, combine=rule, backend="torch"), seq)


@pytest.mark.parametrize("lens,hkv,g,dtype,dot,coef", [
    ("a", 1, 4, F32, "auto", 2), ("b", 2, 2, BF16, "fp16", 3), ("c", 1, 1, BF16, "fp16", 2),
    ("d", 2, 8, F16, "auto", 3), ("e", 1, 4, BF16, "fp16", 3),
])
def test_packed_score_kernel_at_256(lens, hkv, g, dtype, dot, coef):
    """The packed kernel (what ``"auto"`` runs on CUDA at D = 256 for half-precision queries), both
    coefficient contractions, 16 pages per step as its D = 256 launches."""
    from kvlocks.scoring import triton_packed

    q, k, _, table, seq = make_paged(LENS[lens], hkv, g, D, dtype)
    store = built_store(k, table, seq, LocksConfig())
    got = triton_packed.score_pages_packed(q, store, table, seq, launch={"BLOCK": 16}, unpack=1, dot=dot, coef=coef)
    _assert_scores_match(got, paged_score(q, store, table, seq, backend="torch"), seq)


@pytest.mark.parametrize("g,dtype", [(4, F32), (2, BF16), (8, F16)])
def test_centroid_score_kernel_at_256(g, dtype):
    """``log S + scale q.mu`` from the stored int8 centroids, and each head's log-sum-exp."""
    from kvlocks.scoring.triton_centroid import score_pages_centroid

    q, k, _, table, seq = make_paged(LENS["e"], 1, g, D, dtype)
    store = built_store(k, table, seq, LocksConfig())
    scores, lse, _ = score_pages_centroid(q, store, table, seq)
    tol = 2e-4 if dtype == F32 else 2e-2
    for b in range(len(seq)):
        pc = int(seq[b]) // S
        ids = table[b, :pc].long()
        mu = store.centroid[ids].double() * store.centroid_scale[ids].double()[..., None]  # [P, 1, D]
        want = math.log(S) + torch.einsum("gd,pd->gp", q[b].double(), mu[:, 0]) / math.sqrt(D)
        torch.testing.assert_close(scores[b, 0, :, :pc].double(), want, rtol=tol, atol=tol * 10)
        torch.testing.assert_close(lse[b, 0].double(), torch.logsumexp(want, -1), rtol=tol, atol=tol * 10)


def test_score_kernel_choice_at_256():
    """The CUDA score kernel is never chosen at D = 256: ``"auto"`` takes the packed kernel on CUDA
    for half-precision queries (the three-dot kernel elsewhere); pinned, it is refused by name."""
    q = torch.zeros(1, 4, D, device=DEV, dtype=BF16 if CUDA else F32)
    assert score_kernel(q, 4, 8, 64, cuda_library=lambda: True) == ("packed" if CUDA else "mma")
    with pytest.raises(ValueError, match=r"score kernel 'cuda' needs .*D in \(64, 128\).*D=256"):
        score_kernel(q, 4, 8, 64, choice="cuda", cuda_library=lambda: True)
    assert score_kernel(q, 4, 8, 64, choice="packed") == "packed"


@pytest.mark.parametrize("d,why", [(256, None), (96, "head_dim=96: the Triton kernels support head_dim in (64, 128, 256)"),
                                   (512, "head_dim=512: the Triton kernels support head_dim in (64, 128, 256)")])
def test_decode_plan_accepts_256_and_names_the_allowed_head_dims(d, why):
    assert kernel_support(page_size=S, rank=8, head_dim=d) == why
    plan = dict(batch=1, num_kv_heads=1, group=4, head_dim=d, max_pages=4, config=LocksConfig(), dtype=F32,
                device=DEV, backend="triton")
    if why is None:
        DecodePlan(**plan)
    else:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            DecodePlan(**plan)


@pytest.mark.parametrize("dtype,rank", [(F32, 0), (BF16, 0), (F32, 5), (F16, 12)])
def test_lean_build_at_256(dtype, rank):
    """The lean solver ("auto" at D = 256 with any Triton) against the float64 reference, with the
    checks of ``test_kernels.test_build_matches_reference``, the reconstruction bound at 4e-3 instead
    of 2e-3: one int4 rounding-boundary flip of the float32 solve moves a D = 256 page's
    reconstruction by ~8e-3 of its norm (a basis element by a scale of ~0.03 times sigma ~16,
    against a norm of 64), and at most 1 in 500 of the int4 basis values may flip."""
    from kvlocks.summary.build import build_summaries, spectral_basis
    from kvlocks.summary.triton import build_summaries as build_kernel

    keys = tk.page_keys(D, rank, 16 if not CUDA else 500).to(dtype)
    cfg = LocksConfig()
    got = tk._cpu(build_kernel(keys.to(DEV), cfg, solver="lean"))
    ref = build_summaries(keys, cfg)
    assert float((tk._recon(got) - tk._recon(ref)).norm() / keys.float().norm()) < 4e-3
    sign = torch.where((got.basis_float() * ref.basis_float()).sum(-1) < 0, -1, 1)  # eigenvector signs are arbitrary
    flips = (_int4(got.basis) != sign[..., None] * _int4(ref.basis)).float().mean()
    assert float(flips) < 2e-3, float(flips)


def _int4(packed):
    """int4 basis values ``[..., D]`` from their packed bytes ``[..., D / 2]`` (low nibble first)."""
    q = packed.to(torch.int32)
    return torch.stack((((q & 15) ^ 8) - 8, ((q >> 4) ^ 8) - 8), -1).flatten(-2)
    assert (got.centroid.int() - ref.centroid.int()).abs().max() <= 1
    _, _, _, _, sigma = spectral_basis(keys, cfg.rank)
    assert torch.allclose(got.sigma[..., :cfg.rank], sigma[..., :cfg.rank], atol=2e-3 * float(sigma.max()))
    assert torch.equal(got.basis_float().norm(dim=-1) > 0, ref.basis_float().norm(dim=-1) > 0)


def test_one_sided_build_is_refused_at_256():
    """"auto" takes lean at D = 256; the one-sided solver pinned there is refused by name (its 5
    sweeps left a page of random bf16 keys 0.28 off the reference: ``summary.triton.ONESIDED_MAX_D``)."""
    from kvlocks.summary.triton import resolve_solver

    assert resolve_solver("auto", D) == "lean" and resolve_solver("lean", D) == "lean"
    with pytest.raises(ValueError, match="build_solver='onesided' at head_dim=256: .* up to 128"):
        resolve_solver("onesided", D)
    _, k, _, table, seq = make_paged([S], 1, 1, D, BF16)
    store = SummaryStore.empty(k.shape[0], 1, D, LocksConfig(), device=DEV)
    with pytest.raises(ValueError, match="build_solver='onesided' at head_dim=256"):
        paged_build_new(k, store, table, seq, LocksConfig(), backend="triton",
                        options=KernelOptions(build_solver="onesided"))


@pytest.mark.parametrize("solver", ["auto", "lean"])
def test_incremental_build_at_256(solver):
    """The decode-time build of the pages that just filled, at D = 256 (Hkv = 1, Gemma 3 270M)."""
    cfg = LocksConfig()
    _, k, _, table, seq = make_paged([2 * S, 3 * S + 1, S - 1, S], 1, 1, D, BF16)
    stores = []
    for backend in ("triton", "torch"):
        store = SummaryStore.empty(k.shape[0], 1, D, cfg, device=DEV)
        store.coef.fill_(99)
        paged_build_new(k, store, table, seq, cfg, backend=backend, options=KernelOptions(build_solver=solver))
        stores.append(store)
    touched = (stores[1].coef != 99).flatten(1).any(1)
    assert int(touched.sum()) == 2 and torch.equal((stores[0].coef != 99).flatten(1).any(1), touched)
    ids = touched.nonzero()[:, 0]

    def recon(s):
        s = s.gather(ids)
        return s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float()

    assert float((recon(stores[0]) - recon(stores[1])).abs().max()) < 1e-2


@pytest.mark.parametrize("lens,g,dtype,k", [
    ("a", 4, F32, 2), ("b", 2, BF16, 2), ("c", 1, F16, 5), ("d", 8, BF16, 3), ("e", 4, BF16, 400),
])
def test_attention_at_256(lens, g, dtype, k):
    """Split-KV sparse and dense decode at D = 256 (the kernel reads half the pages per step there:
    ``attention.triton.step_pages``), budgets of 2 pages (sink + recent), a few, and every page."""
    from kvlocks.attention.triton import step_pages

    assert [step_pages(p, D) for p in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 8]
    tk.test_attention_matches_reference(lens, g, D, dtype, k)


@pytest.mark.parametrize("g,rule,dtype,mult", [(4, "mean_share", BF16, 4), (2, "sum_mass", F32, 2),
                                               (8, "max_share", F16, 8)])
def test_rerank_exact_masses_at_256(g, rule, dtype, mult):
    """The exact re-rank's kernels at D = 256 pick the full-width PyTorch re-rank's pages."""
    from kvlocks.plan import paged_select
    from kvlocks.selection.rerank_paged import paged_rerank
    from kvlocks.selection.triton_rerank import rerank_pages

    cfg = LocksConfig(budget=64, rerank=mult, combine=rule)
    q, k, _, table, seq = make_paged([40 * S, 23 * S + 5, 2 * S + 3], 2, g, D, dtype, seed=g)
    store = built_store(k, table, seq, cfg)
    scores, lse, ranking = paged_score(q, store, table, seq, combine=rule, backend="torch")
    width = table.shape[1]
    kc = min(width, cfg.rerank_candidates(width) + cfg.sink_pages + cfg.recent_pages)
    sel = dict(page_size=S, sink_pages=cfg.sink_pages, recent_pages=cfg.recent_pages, backend="torch")
    cand = paged_select(ranking, seq, k=kc, **sel).contiguous()
    want = paged_select(paged_rerank(q, k, table, seq, scores, cfg, scale=D ** -0.5), seq, k=cfg.pages_per_step, **sel)
    got = rerank_pages(q, k, table, seq, scores, lse, cand, cfg, scale=D ** -0.5)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("lens,hkv,g,dtype,budget", [
    ("c", 1, 4, F32, 32), ("d", 2, 2, BF16, 64), ("b", 1, 4, BF16, 4096), ("e", 2, 8, F32, 160),
    ("e", 1, 1, F16, 48),
])
def test_decode_plan_at_256_matches_torch_backend(lens, hkv, g, dtype, budget):
    """The whole step (score, fused combine + selection, attention) on the Triton backend picks the
    torch backend's pages and gives its output: budgets of 2 pages (the forced ones), a few, and
    more than every page."""
    cfg = LocksConfig(budget=budget)
    q, k, v, table, seq = make_paged(LENS[lens], hkv, g, D, dtype, seed=3)
    store = built_store(k, table, seq, cfg)
    kw = dict(batch=len(seq), num_kv_heads=hkv, group=g, head_dim=D, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    tri, ref = DecodePlan(backend="triton", **kw), DecodePlan(backend="torch", **kw)
    out_t = tri.run(q, k, v, store, table, seq)
    out_r = ref.run(q, k, v, store, table, seq)
    assert torch.equal(tri.pages.cpu(), ref.pages.cpu())
    tol = 1e-4 if dtype == F32 else 2e-2
    assert torch.allclose(out_t[0].float(), out_r[0].float(), atol=tol, rtol=tol)
    assert torch.allclose(out_t[1], out_r[1], atol=1e-3)


@pytest.mark.skipif(not CUDA, reason="inline PTX unpacking and CUDA graphs need a GPU")
@pytest.mark.parametrize("hkv,g", [(8, 2), (1, 4)])
def test_decode_step_at_256_on_cuda_uses_packed_scores_and_is_graph_capturable(hkv, g):
    """Gemma-3-12B's and 270M's shapes at 100K tokens: the plan scores with the packed kernel (PTX
    unpacking), picks the torch backend's pages, and its step replays in a CUDA graph bit for bit."""
    cfg = LocksConfig(budget=2048)
    q, k, v, table, seq = make_paged([100_000, 40_000], hkv, g, D, BF16, seed=5)
    store = built_store(k, table, seq, cfg)
    assert score_kernel(q, g, 8, 64, cuda_library=lambda: True) == "packed"
    kw = dict(batch=2, num_kv_heads=hkv, group=g, head_dim=D, max_pages=table.shape[1], config=cfg, dtype=q.dtype,
              device=DEV)
    plan, ref = DecodePlan(**kw), DecodePlan(backend="torch", **kw)
    eager = [t.clone() for t in plan.run(q, k, v, store, table, seq)]
    want = ref.run(q, k, v, store, table, seq)
    assert torch.equal(plan.pages, ref.pages)
    assert torch.allclose(eager[0].float(), want[0].float(), atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, k, v, store, table, seq)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
