"""Triton decode kernels against the PyTorch references (the spec).

Without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set here before
any kernel module is imported; kernel modules are imported by nothing else on the CPU), at small
sizes. With a GPU the same tests run compiled, at larger sizes.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvlocks.attention import reference as attn_ref  # noqa: E402
from kvlocks.attention import triton as attn_tri  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.dispatch import (  # noqa: E402
    FUSED_MIN_PAGES, DecodePlan, build_new_pages, build_pages, paged_decode, score_pages, select_pages,
)
from kvlocks.cache.layout import PagedSummaries  # noqa: E402
from kvlocks.scoring import reference as score_ref  # noqa: E402
from kvlocks.scoring import triton as score_tri  # noqa: E402
from kvlocks.selection import triton as sel_tri  # noqa: E402
from kvlocks.selection.topk import select_top_pages  # noqa: E402
from kvlocks.summary import triton as build_tri  # noqa: E402
from kvlocks.summary.build import build_summaries, spectral_basis  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
S = 16
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _heavy(seconds, *values):
    """A parameter set whose test compiles the one-sided build kernel (minutes with the GPU image's
    Triton 3.6; ``seconds``: its time on the H200 in session 15): GPU runs start it first (conftest)."""
    return pytest.param(*values, marks=pytest.mark.compile_heavy(seconds))

# token counts per sequence: the CPU interpreter gets small ones, the GPU real ones
LENS = {
    "a": [1, 15] if not CUDA else [1, 15, 4096],
    "b": [16, 17] if not CUDA else [16, 17, 65536],
    "c": [100, 33] if not CUDA else [100_000, 33, 2049],
    "d": [130] if not CUDA else [262_144],
    "e": [300 * 16 + 5, 40 * 16 + 3] if not CUDA else [70_000, 300 * 16 + 5],  # many pages: several chunks
}


def make_paged(lens, hkv, g, d, dtype, *, extra=3, seed=0):
    """Random K/V in a shuffled paged cache ``[num_pages, S, Hkv, D]``, block table, queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lens]
    max_pages, num_pages = max(need), sum(need) + extra
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    at = 0
    for b, p in enumerate(need):
        table[b, :p] = perm[at : at + p].to(torch.int32)
        at += p
    k = torch.randn(num_pages, S, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_pages, S, hkv, d, generator=gen).to(dtype)
    q = (torch.randn(len(lens), hkv * g, d, generator=gen) * 1.5).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEV) for t in (q, k, v, table, seq)]


def built_store(k, table, seq, cfg):
    """Summaries of every full page, by the reference build (float64 eigh; on a GPU it runs there:
    the 262,144-token cases took most of a device call's time limit on the CPU)."""
    store = PagedSummaries.empty(k.shape[0], k.shape[2], k.shape[3], cfg, device=k.device)
    full = torch.cat([table[b, : int(seq[b]) // S] for b in range(len(seq))])
    build_pages(k, store, full, cfg, backend="torch")
    return store


@pytest.mark.parametrize("lens,g,d,dtype,rule", [
    ("a", 1, 64, F32, "mean_share"), ("b", 3, 128, BF16, "mean_share"), ("c", 4, 64, F16, "max_share"),
    ("d", 8, 128, F32, "sum_mass"), ("b", 16, 64, BF16, "mean_share"),
])
def test_score_matches_reference(lens, g, d, dtype, rule):
    cfg = LocksConfig(combine=rule)
    q, k, _, table, seq = make_paged(LENS[lens], 2, g, d, dtype)
    store = built_store(k, table, seq, cfg)
    got = score_pages(q, store, table, seq, combine=rule, backend="triton")
    exp = score_pages(q, store, table, seq, combine=rule, backend="torch")
    _assert_scores_match(got, exp, seq)


def _assert_scores_match(got, exp, seq):
    """(scores, lse, ranking) of the kernel against the torch backend, over each sequence's full pages."""
    for b in range(len(seq)):
        pc = int(seq[b]) // S
        for name, x, y in zip(("scores", "lse", "ranking"), got, exp):
            xb, yb = (x[b], y[b]) if name == "lse" else (x[b, ..., :pc], y[b, ..., :pc])
            assert torch.allclose(xb, yb, rtol=1e-4, atol=1e-4 * max(1.0, float(yb.abs().max()) if pc else 1.0)), name


@pytest.mark.parametrize("rank", [4, 16])  # other ranks than the default 8 (basis rows padded to 16 or not)
def test_score_matches_reference_other_ranks(rank):
    cfg = LocksConfig(rank=rank)
    q, k, _, table, seq = make_paged(LENS["c"], 2, 4, 64, BF16)
    store = built_store(k, table, seq, cfg)
    got = score_pages(q, store, table, seq, backend="triton")
    exp = score_pages(q, store, table, seq, backend="torch")
    _assert_scores_match(got, exp, seq)


@pytest.mark.parametrize("launch", [{"BLOCK": 8}, {"BLOCK": 32, "num_warps": 4}])
def test_score_kernel_step_sizes_agree(launch):
    """Every step size the autotuner may pick gives the reference's scores (16 is tested above)."""
    q, k, _, table, seq = make_paged(LENS["c"], 2, 3, 128, BF16)
    store = built_store(k, table, seq, LocksConfig())
    ws = score_tri.score_workspace(len(seq), 2, 3, table.shape[1], q.device)
    ws["launch"], ws["kernel"] = launch, "mma"  # the Triton three-dot kernel (on CUDA "auto" may pick the CUDA kernel)
    got = score_pages(q, store, table, seq, backend="triton", workspace=ws)
    exp = score_pages(q, store, table, seq, backend="torch")
    _assert_scores_match(got, exp, seq)


@pytest.mark.parametrize("lens,g,d,dtype,dot,coef,block", [
    ("a", 1, 64, F32, "auto", 2, 8), ("b", 3, 128, BF16, "auto", 3, 8), ("c", 4, 64, F16, "auto", 2, 8),
    ("b", 4, 128, BF16, "fp16", 3, 16), ("c", 2, 128, F16, "fp16", 3, 8), ("b", 8, 128, BF16, "fp16", 3, 16),
    ("a", 6, 64, F32, "auto", 3, 8), ("c", 8, 64, F16, "auto", 2, 8), ("c", 1, 128, BF16, "fp16", None, 16),
    ("c", 4, 64, BF16, "auto", None, 16), ("b", 16, 64, BF16, "fp16", None, 8),
])
def test_packed_score_kernel_matches_reference(lens, g, d, dtype, dot, coef, block):
    """The packed kernel (portable unpacking; float16 dots with q scaled into range for dot="fp16"),
    both coefficient contractions (3: block-diagonal page-pair dots, 2: FMA broadcast)."""
    from kvlocks.scoring import triton_packed

    q, k, _, table, seq = make_paged(LENS[lens], 2, g, d, dtype)
    store = built_store(k, table, seq, LocksConfig())
    got = triton_packed.score_pages_packed(q, store, table, seq, launch={"BLOCK": block}, unpack=1, dot=dot,
                                           coef=coef)
    exp = score_pages(q, store, table, seq, backend="torch")
    _assert_scores_match(got, exp, seq)


@pytest.mark.parametrize("kw,needle", [({"coef": 4}, "coef=4"), ({"unpack": 3}, "unpack=3"), ({"dot": "bf16"}, "dot=")])
def test_packed_score_kernel_rejects_bad_options(kw, needle):
    from kvlocks.scoring import triton_packed

    q, k, _, table, seq = make_paged(LENS["a"], 2, 4, 64, F32)
    store = built_store(k, table, seq, LocksConfig())
    with pytest.raises(ValueError, match=needle):
        triton_packed.score_pages_packed(q, store, table, seq, **kw)


def test_packed_score_kernel_scales_large_and_small_queries():
    """float16 dots stay exact when q is far outside float16's range (power-of-two scaling)."""
    from kvlocks.scoring import triton_packed

    q, k, _, table, seq = make_paged(LENS["c"], 2, 4, 64, F32)
    store = built_store(k, table, seq, LocksConfig())
    for factor in (3e5, 1e-6):
        qs = (q * factor).to(BF16)
        got = triton_packed.score_pages_packed(qs, store, table, seq, launch={"BLOCK": 8}, unpack=1, dot="fp16",
                                               scale=1.0 / factor)
        exp = score_pages(qs, store, table, seq, backend="torch", scale=1.0 / factor)
        _assert_scores_match(got, exp, seq)


@pytest.mark.skipif(not CUDA, reason="inline PTX unpacking runs on CUDA only (GPU runs: scripts/device/score_probe.py --check)")
def test_packed_score_kernel_ptx_unpack_matches_reference():
    from kvlocks.scoring import triton_packed

    for g, d in ((1, 128), (2, 64), (3, 128), (4, 128), (8, 128), (16, 64)):
        q, k, _, table, seq = make_paged(LENS["b"], 2, g, d, BF16)
        store = built_store(k, table, seq, LocksConfig())
        assert triton_packed.supports(q, g, 8)  # what score_pages runs on CUDA without the CUDA kernel
        got = triton_packed.score_pages_packed(q, store, table, seq, unpack=2)
        exp = score_pages(q, store, table, seq, backend="torch")
        _assert_scores_match(got, exp, seq)


@pytest.mark.skipif(not CUDA, reason="CUDA kernel: needs a GPU (GPU runs: scripts/device/mma_probe.py --check)")
@pytest.mark.parametrize("g,d,dtype,factor", [
    (1, 128, BF16, 1.0), (3, 64, F16, 1.0), (4, 128, BF16, 1.0), (8, 128, BF16, 1.0), (8, 128, F16, 40.0),
    (16, 64, BF16, 1.0), (16, 128, BF16, 1e4), (12, 128, F16, 1e-6),
])
def test_cuda_score_kernel_matches_reference(g, d, dtype, factor):
    """The CUDA kernel (what score_pages runs on CUDA) against the torch backend; factor 40 makes
    logits overflow exp2 and takes the exact max-subtracted path, 1e4 / 1e-6 test the query scaling."""
    from kvlocks.scoring import cuda_mma

    q, k, _, table, seq = make_paged(LENS["c"], 2, g, d, dtype)
    q = (q.float() * factor).to(dtype)
    store = built_store(k, table, seq, LocksConfig())
    assert cuda_mma.supports(q, g, store), cuda_mma.unavailable_reason(q.device)
    scale = 1.0 / (factor * d ** 0.5) if factor != 40.0 else None
    # default sizing; warps whose tiles end early; several tiles per warp; then the balanced split
    # (each sequence's tiles evenly over the programs): more programs than the short rows' tiles,
    # runs of a few tiles, one program per row; and the six-blocks-per-SM variant (D = 128, G <= 8;
    # elsewhere the request falls back to the default variant)
    for ppp, balanced, blocks in ((None, False, 1), (16, False, 1), (48, False, 1), (5, True, 1), (100, True, 1),
                                  (1 << 20, True, 1), (16, False, 6), (48, False, 6), (100, True, 6)):
        ws = None if ppp is None else score_tri.score_workspace(len(seq), 2, g, table.shape[1], q.device, ppp)
        if ws is not None:
            ws["balanced"], ws["min_blocks"] = balanced, blocks
        got = cuda_mma.score_pages_mma(q, store, table, seq, scale=scale, workspace=ws)
        exp = score_pages(q, store, table, seq, backend="torch", scale=scale)
        _assert_scores_match(got, exp, seq)


def test_cuda_score_kernel_rejects_unsupported_inputs():
    from kvlocks.scoring import cuda_mma

    q, k, _, table, seq = make_paged(LENS["a"], 2, 4, 64, F32)
    store = built_store(k, table, seq, LocksConfig())
    with pytest.raises(ValueError, match="float16/bfloat16"):
        cuda_mma.score_pages_mma(q, store, table, seq)


def test_score_adapters_same_signature():
    pages = torch.randn(2, 5, S, 64, device=DEV)
    summ = build_summaries(pages, LocksConfig())
    q = torch.randn(2, 3, 64, device=DEV)
    exp = score_ref.score_pages_from_summaries(q, summ)
    got = score_tri.score_pages_from_summaries(q, summ)
    assert torch.allclose(got, exp, atol=1e-4)
    for rule in ("mean_share", "max_share", "sum_mass"):
        assert torch.allclose(score_tri.combine_group(exp, rule), score_ref.combine_group(exp, rule), atol=1e-6)


SELECT_CASES = [  # (token counts, k, sink, recent, ties, sink_start)
    ([1, 16, 17], 2, 1, 1, False, False), ([40 * S, 40 * S + 3], 2, 1, 1, True, False),
    ([40 * S + 5, 7 * S], 5, 1, 1, True, False), ([300 * S, 299 * S + 1], 20, 2, 2, True, False),
    ([300 * S], 300, 1, 1, False, False), ([90 * S + 1, 33 * S], 9, 0, 1, True, False),
    ([90 * S, 20 * S + 4], 6, 1, 2, True, True),
]


@pytest.mark.parametrize("early,regs,bits,skip", [(False, False, 4, False), (True, False, 4, False),
                                                  (True, True, 4, False), (False, True, 4, False),
                                                  (True, True, 5, False), (False, False, 5, False),
                                                  (True, True, 5, True), (False, False, 4, True),
                                                  (True, False, 5, True)])
@pytest.mark.parametrize("lens,k,sink,recent,ties,with_ss", SELECT_CASES)
def test_select_matches_reference(lens, k, sink, recent, ties, with_ss, early, regs, bits, skip):
    gen = torch.Generator().manual_seed(k)
    bsz, hkv, max_pages = len(lens), 3, max(-(-n // S) for n in lens)
    ranking = torch.rand(bsz, hkv, max_pages, generator=gen)
    if ties:  # coarse values and many exact zeros (underflowed shares): ties broken by index
        ranking = (ranking * 3).floor() / 3
    if skip:  # rebased keys: one row narrow (sign, exponent and 12 mantissa bits shared), one constant
        # (every key equal: ties broken by index), the others as they are
        ranking[0, 0] = 0.5 + ranking[0, 0] * 2.0**-13
        ranking[-1, 1] = 0.25
    seq = torch.tensor(lens, dtype=torch.int32)
    ss = torch.randint(0, 4, (bsz,), generator=gen, dtype=torch.int32) if with_ss else None
    ws = sel_tri.select_workspace(bsz, hkv, max_pages, k, DEV, chunk=32)  # several chunks per row
    ws["early_exit"] = early  # radix passes stopped once the threshold digit is settled: same pages
    ws["merge_in_registers"] = regs  # the merge's passes on one register tile (where the winners fit)
    ws["digit_bits"] = bits  # 4-bit digits (eight passes) or 5-bit (seven, the last 2 bits wide)
    ws["rebase_keys"] = skip  # radix passes over keys rebased per program (minus the minimum, shifted)
    dv = [t.to(DEV) if t is not None else None for t in (ranking, seq, ss)]
    got = sel_tri.select_pages_paged(dv[0], dv[1], page_size=S, k=k, sink_pages=sink, recent_pages=recent,
                                     sink_start=dv[2], workspace=ws)
    exp = select_pages(dv[0], dv[1], page_size=S, k=k, sink_pages=sink, recent_pages=recent, sink_start=dv[2],
                       backend="torch")
    assert torch.equal(got.cpu(), exp.cpu())


def test_select_adapter_same_signature():
    r = torch.rand(2, 3, 25, device=DEV)
    for total, k in ((25, 4), (26, 2), (26, 40)):
        exp = select_top_pages(r, total, k)
        assert torch.equal(sel_tri.select_top_pages(r, total, k), exp)


FUSED_CASES = [  # (token counts, G, combine rule, pages per program or None = default, k, sink, recent, sink_start)
    ("c", 4, "mean_share", None, 6, 1, 1, False), ("c", 3, "max_share", 32, 9, 2, 2, True),
    ("d", 8, "sum_mass", 64, 20, 1, 1, False), ("b", 16, "mean_share", 16, 3, 0, 1, False),
    ("d", 1, "mean_share", None, 300, 1, 1, False), ("e", 4, "mean_share", 16, 12, 1, 2, True),
    ("e", 2, "mean_share", 16, 40, 1, 1, False),  # fewer pages per program than pages to choose
]


@pytest.mark.parametrize("lens,g,rule,chunk,k,sink,recent,with_ss", FUSED_CASES)
def test_rank_and_select_matches_reference(lens, g, rule, chunk, k, sink, recent, with_ss):
    """The fused combine + selection: ranking and LSE against the reference combine of the same
    scores, pages exactly the reference selection of its ranking (and of the reference ranking, on
    this tie-free data); the per-row counters are left at zero, so a second call agrees."""
    from kvlocks.selection import fused

    cfg = LocksConfig(budget=64)
    q, k_, v, table, seq = make_paged(LENS[lens], 2, g, 64, F32, seed=7)
    store = built_store(k_, table, seq, cfg)
    bsz, max_pages = len(seq), table.shape[1]
    ss = torch.tensor([1, 0, 2][:bsz], dtype=torch.int32, device=DEV) if with_ss else None
    sw = score_tri.score_workspace(bsz, 2, g, max_pages, DEV)
    _, none_lse, none_rank = score_tri.score_pages_paged(q, store, table, seq, combine=rule, workspace=sw, rank=False)
    assert none_lse is None and none_rank is None
    fw = fused.fused_workspace(bsz, 2, max_pages, k, DEV, chunk=chunk)
    fw["unroll_heads"] = chunk == 32  # the compile-time loop over the heads, in one case
    fw["early_exit"] = chunk in (16, 64)  # the early-stopping radix passes, in two cases
    fw["merge_in_registers"] = chunk in (16, 32)  # the merge on one register tile, in three cases
    fw["digit_bits"] = 5 if chunk in (32, 64) else 4  # 5-bit radix digits, in two cases
    fw["rebase_keys"] = chunk in (None, 64)  # radix passes over rebased keys, in three cases
    sel = dict(page_size=S, k=k, sink_pages=sink, recent_pages=recent, sink_start=ss)
    got = fused.rank_and_select(sw, seq, combine=rule, workspace=fw, **sel).clone()
    _, lse, ranking = score_pages(q, store, table, seq, combine=rule, backend="torch")
    for b, n in enumerate(LENS[lens]):
        pc = n // S
        assert torch.allclose(sw["ranking"][b, :, :pc].cpu(), ranking[b, :, :pc].cpu(), rtol=1e-5, atol=1e-30)
        assert torch.allclose(sw["lse"][b].cpu(), lse[b].cpu(), atol=1e-4) or pc == 0
    assert torch.equal(got.cpu(), select_pages(sw["ranking"], seq, backend="torch", **sel).cpu())
    assert torch.equal(got.cpu(), select_pages(ranking, seq, backend="torch", **sel).cpu())
    assert int(fw["done"].abs().sum()) == 0
    assert torch.equal(fused.rank_and_select(sw, seq, combine=rule, workspace=fw, **sel).cpu(), got.cpu())


@pytest.mark.parametrize("early,regs,bits,skip", [(False, False, 4, False), (True, False, 4, False),
                                                  (True, True, 4, False), (True, True, 5, False),
                                                  (False, False, 5, False), (True, True, 5, True)])
@pytest.mark.parametrize("chunk", [16, 64, None])
def test_rank_and_select_breaks_ties_by_page_index(chunk, early, regs, bits, skip):
    """Hand-made scores with many exact ties (and statistics of one score program): the fused
    kernel picks exactly what the reference selection picks from the same ranking."""
    from kvlocks.selection import fused

    gen = torch.Generator().manual_seed(11)
    bsz, hkv, g, pages, k = 2, 3, 4, 200, 10
    seq = torch.tensor([pages * S, 150 * S + 7], dtype=torch.int32)
    sw = score_tri.score_workspace(bsz, hkv, g, pages, "cpu", pages_per_program=pages)
    scores = (torch.rand(bsz, hkv, g, pages, generator=gen) * 3).floor() - 40.0  # three levels per head
    sw["scores"].copy_(scores)
    s2 = scores * score_tri.LOG2E
    m = s2.amax(-1)
    sw["stats"].zero_()
    sw["stats"][:, 0, 0, :g] = m.reshape(bsz * hkv, g)
    sw["stats"][:, 0, 1, :g] = torch.exp2(s2 - m[..., None]).sum(-1).reshape(bsz * hkv, g)
    sw = {key: t.to(DEV) if isinstance(t, torch.Tensor) else t for key, t in sw.items()}
    fw = fused.fused_workspace(bsz, hkv, pages, k, DEV, chunk=chunk)
    fw["early_exit"] = early
    fw["merge_in_registers"] = regs
    fw["digit_bits"] = bits
    fw["rebase_keys"] = skip
    got = fused.rank_and_select(sw, seq.to(DEV), page_size=S, k=k, workspace=fw)
    exp = select_pages(sw["ranking"], seq.to(DEV), page_size=S, k=k, backend="torch")
    assert torch.equal(got.cpu(), exp.cpu())
    assert len(torch.unique(sw["ranking"][0, 0])) <= 81  # ties are real: at most 3^4 distinct rankings


def test_rank_and_select_rejects_bad_arguments():
    from kvlocks.selection import fused

    sw = score_tri.score_workspace(1, 2, 4, 8, DEV)
    seq = torch.tensor([64], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="combine rule"):
        fused.rank_and_select(sw, seq, page_size=S, k=4, combine="median")
    with pytest.raises(ValueError, match="k=1"):
        fused.rank_and_select(sw, seq, page_size=S, k=1, sink_pages=1, recent_pages=1)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        fused.rank_and_select(sw, seq.long(), page_size=S, k=4)
    with pytest.raises(ValueError, match="workspace is for output"):
        fused.rank_and_select(sw, seq, page_size=S, k=4, workspace=fused.fused_workspace(1, 2, 8, 5, DEV))
    bad_bits = dict(fused.fused_workspace(1, 2, 8, 4, DEV), digit_bits=6)
    with pytest.raises(ValueError, match="digit_bits=6: allowed 4 or 5"):
        fused.rank_and_select(sw, seq, page_size=S, k=4, workspace=bad_bits)


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("lens,g,d,dtype,k", [
    ("a", 1, 64, F32, 2), ("b", 3, 128, BF16, 2), ("c", 4, 64, F16, 3), ("d", 8, 128, BF16, 5),
    ("c", 16, 128, F32, 64),
])
def test_attention_matches_reference(lens, g, d, dtype, k, fused_merge, monkeypatch):
    """Split-KV decode over page lists and over every page, against the references; also with the
    merge done by each row's last split (MERGE_IN_KERNEL), whose counters end at zero."""
    monkeypatch.setattr(attn_tri, "MERGE_IN_KERNEL", fused_merge)
    q, kc, vc, table, seq = make_paged(LENS[lens], 2, g, d, dtype, seed=k)
    gen = torch.Generator().manual_seed(1)
    bsz, hkv = len(seq), 2
    pl = torch.full((bsz, hkv, k), -1, dtype=torch.int32)
    for b in range(bsz):
        total = -(-int(seq[b]) // S)
        for h in range(hkv):  # distinct pages in random order (the kernel needs no order)
            pl[b, h, : min(k, total)] = torch.randperm(total, generator=gen)[:k].to(torch.int32)
    pl = pl.to(DEV)
    got = paged_decode(q, kc, vc, table, seq, pl, backend="triton")
    exp = paged_decode(q, kc, vc, table, seq, pl, backend="torch")
    tol = 1e-4 if dtype == F32 else 2e-2
    assert torch.allclose(got[0].float(), exp[0].float(), atol=tol, rtol=tol)
    assert torch.allclose(got[1], exp[1], atol=1e-3)
    dense = attn_tri.identity_pages(bsz, hkv, table.shape[1], DEV)
    got = paged_decode(q, kc, vc, table, seq, dense, backend="triton")
    for b in range(bsz):
        n = int(seq[b])
        keys = kc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
        vals = vc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
        o, lse = attn_ref.dense_decode(q[b].view(hkv, g, d), keys, vals)
        assert torch.allclose(got[0][b].float(), o.reshape(-1, d).float(), atol=tol, rtol=tol)
        assert torch.allclose(got[1][b], lse.reshape(-1), atol=1e-3)
    # one page per split, up to 7 splits: the merge's steps of 4 splits, the last one partial
    n_pages = table.shape[1]
    ws = attn_tri.attention_workspace(bsz, hkv * g, d, n_pages, bsz * hkv, q.dtype, DEV, num_splits=min(7, n_pages),
                                      ppi=1)
    first = [t.clone() for t in attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=ws)]
    assert int(ws["done"].abs().sum()) == 0  # counters reset by each row's merging program
    again = attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=ws)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert torch.allclose(first[0].float(), got[0].float(), atol=tol, rtol=tol)
    assert torch.allclose(first[1], got[1], atol=1e-3)


def test_attention_adapters_same_signature():
    q, k, v = (torch.randn(2, 3, n, 64, device=DEV) for n in (4, 37, 37))
    ids = torch.tensor([[0, 2], [1, 2]], device=DEV).view(2, 1, 2).expand(2, 3, 2)
    for got, exp in ((attn_tri.sparse_decode(q, k, v, ids, S), attn_ref.sparse_decode(q, k, v, ids, S)),
                     (attn_tri.dense_decode(q, k, v), attn_ref.dense_decode(q, k, v))):
        assert torch.allclose(got[0], exp[0], atol=1e-4) and torch.allclose(got[1], exp[1], atol=1e-4)


def _cpu(s):
    return s._map(lambda _, t: t.cpu())


def _recon(s):
    return s.centroid_float()[..., None, :] + s.coef_float() @ s.basis_float()


@pytest.mark.parametrize("rotation,finish", [("gathers", "dots"), ("lean", "dots"), ("dots", "dots"),
                                             ("lean", "loop"), ("xor", "dots"), ("xor_unrolled", "dots"),
                                             _heavy(110, "onesided", "loop")])
@pytest.mark.parametrize("d,dtype,rank", [(64, F32, 0), (128, BF16, 0), (128, F32, 5), (64, F16, 12)])
def test_build_matches_reference(d, dtype, rank, rotation, finish):
    gen = torch.Generator().manual_seed(d + rank)
    lead, p = (2,), (3 if not CUDA else 500)
    if rank:  # low-rank pages: the subspace is exact and unique
        keys = torch.randn(*lead, p, 1, d, generator=gen) + torch.randn(*lead, p, S, rank, generator=gen) @ \
            torch.randn(*lead, p, rank, d, generator=gen)
    else:
        keys = torch.randn(*lead, p, S, d, generator=gen)
    keys = keys.to(dtype).to(DEV)
    cfg = LocksConfig()
    got = _cpu(build_tri.build_summaries(keys, cfg, rotation=rotation, finish=finish))
    keys = keys.cpu()
    ref = build_summaries(keys, cfg)
    kf = keys.float()
    # same quantized reconstruction up to rounding-boundary flips (float32 vs float64 solve)
    err = (_recon(got) - _recon(ref)).norm() / kf.norm()
    assert float(err) < 2e-3
    assert (got.centroid.int() - ref.centroid.int()).abs().max() <= 1
    _, _, _, _, sigma = spectral_basis(keys, cfg.rank)
    assert torch.allclose(got.sigma[..., :cfg.rank], sigma[..., :cfg.rank], atol=2e-3 * float(sigma.max()))
    kept = ref.basis_float().norm(dim=-1) > 0
    assert torch.equal(got.basis_float().norm(dim=-1) > 0, kept)


@pytest.mark.skipif(not CUDA, reason="register caps are a CUDA compile option (GPU runs: scripts/device/pending10.sh)")
@pytest.mark.parametrize("rotation,finish", [("lean", "loop"), ("lean", "dots"), _heavy(230, "onesided", "loop")])
def test_build_with_register_cap_equals_uncapped(rotation, finish):
    """A register cap (``maxnreg``, as in the tuner's capped launches and the one-sided default
    launch) changes register allocation only: the same summaries bit for bit. Capped launches reload
    the keys after the solver by volatile loads (``RELOAD_VOLATILE``, set by default with a cap), a
    different program (the finish's products may contract differently): the uncapped reference
    takes the same reload."""
    _, k, _, _, _ = make_paged([64 * 1024], 8, 1, 128, BF16, seed=5)
    ids = torch.arange(k.shape[0], dtype=torch.int32, device=DEV)
    cfg = LocksConfig()
    stores = []
    caps = (128, 144) if rotation == "lean" else (build_tri.ONESIDED_LAUNCH["maxnreg"],)
    base = {"BP": 1, "num_warps": 1, "RELOAD_VOLATILE": True}
    for launch in (base, *({**base, "maxnreg": m} for m in caps)):
        store = PagedSummaries.empty(k.shape[0], 8, 128, cfg, device=DEV)
        build_tri.build_pages(k, store, ids, launch=launch, finish=finish, rotation=rotation)
        stores.append(store)
    for other in stores[1:]:
        for name in ("basis", "basis_scale", "coef", "coef_scale", "centroid", "centroid_scale"):
            assert torch.equal(getattr(stores[0], name), getattr(other, name)), name


@triton.jit
def _rint_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, build_tri._rint(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


def test_build_rounding_is_half_to_even_like_torch_round():
    """The build's quantizer rounds by adding and subtracting 1.5 * 2**23: exact ties, their float32
    neighbours and random values in the quantizers' range all round like ``torch.round``."""
    ties = torch.arange(-128, 128, dtype=F32) + 0.5
    near = torch.cat([torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1)])
    rand = (torch.rand(4096, generator=torch.Generator().manual_seed(0)) - 0.5) * 300
    x = torch.cat([ties, near, rand, torch.tensor([0.0, -0.0, 2.0**21 + 0.5, -(2.0**21) - 0.5])]).to(DEV)
    y = torch.empty_like(x)
    _rint_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.cpu(), torch.round(x.cpu()))
    assert torch.equal(y[:256].cpu(), 2 * torch.round(ties / 2))  # ties go to the even neighbour


@pytest.mark.parametrize("rotation", ["lean", _heavy(46, "onesided")])
def test_incremental_build_builds_just_filled_pages(rotation, monkeypatch):
    """Both default solvers (one-sided from Triton 3.9, lean before) in the decode-time launch."""
    monkeypatch.setattr(build_tri, "ROTATION", rotation)
    cfg = LocksConfig()
    q, k, _, table, seq = make_paged([2 * S, 3 * S + 1, S - 1, S], 2, 1, 64, F32)
    store = PagedSummaries.empty(k.shape[0], 2, 64, cfg, device=DEV)
    store.coef.fill_(99)
    build_new_pages(k, store, table, seq, cfg, backend="triton")
    exp = PagedSummaries.empty(k.shape[0], 2, 64, cfg, device=DEV)
    exp.coef.fill_(99)
    build_new_pages(k, exp, table, seq, cfg, backend="torch")
    touched = (exp.coef != 99).flatten(1).any(1)
    assert int(touched.sum()) == 2  # sequences 0 and 3 just filled a page
    assert torch.equal((store.coef != 99).flatten(1).any(1), touched)
    ids = touched.nonzero()[:, 0]
    # eigenvector signs are arbitrary: compare the (sign-free) quantized reconstructions
    assert float((_recon(store.gather(ids)) - _recon(exp.gather(ids))).abs().max()) < 1e-2


@pytest.mark.parametrize("lens,g,budget,fused", [("c", 4, 64, True), ("c", 4, 64, False), ("d", 3, 32, True),
                                                 ("b", 1, 2048, None)])
def test_decode_plan_matches_torch_backend(lens, g, budget, fused):
    cfg = LocksConfig(budget=budget)
    q, k, v, table, seq = make_paged(LENS[lens], 2, g, 64, F32, seed=3)
    store = built_store(k, table, seq, cfg)
    kw = dict(batch=len(seq), num_kv_heads=2, group=g, head_dim=64, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    tri, ref = DecodePlan(backend="triton", fused_select=fused, **kw), DecodePlan(backend="torch", **kw)
    assert tri.fused == (fused if fused is not None else table.shape[1] >= FUSED_MIN_PAGES)
    out_t = tri.run(q, k, v, store, table, seq)
    out_r = ref.run(q, k, v, store, table, seq)
    assert torch.equal(tri.pages.cpu(), ref.pages.cpu())
    assert torch.allclose(out_t[0], out_r[0], atol=1e-4) and torch.allclose(out_t[1], out_r[1], atol=1e-4)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_decode_step_is_graph_capturable():
    cfg = LocksConfig(budget=2048)
    q, k, v, table, seq = make_paged([100_000, 40_000], 4, 4, 128, BF16, seed=5)
    store = built_store(k, table, seq, cfg)
    plan = DecodePlan(batch=2, num_kv_heads=4, group=4, head_dim=128, max_pages=table.shape[1], config=cfg,
                      dtype=q.dtype, device=DEV)
    eager = [t.clone() for t in plan.run(q, k, v, store, table, seq)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = plan.run(q, k, v, store, table, seq)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch needs a GPU")
@pytest.mark.parametrize("score_pdl", [False, True])
def test_decode_step_with_programmatic_dependent_launch_is_unchanged(score_pdl, monkeypatch):
    """kvlocks.pdl on: the score kernel triggers its dependents (and with SCORE_PDL is launched early
    itself), the fused selection, the attention and its merge are launched early and wait; eager and
    graph-replayed steps give bit-for-bit the pages, outputs and LSEs of the same step without PDL,
    and so does the dense split-KV path."""
    from kvlocks import pdl
    from kvlocks.scoring import cuda_mma

    monkeypatch.setattr(cuda_mma, "SCORE_PDL", score_pdl)

    cfg = LocksConfig(budget=2048)
    q, k, v, table, seq = make_paged([100_000, 40_000], 4, 4, 128, BF16, seed=5)
    store = built_store(k, table, seq, cfg)
    kw = dict(batch=2, num_kv_heads=4, group=4, head_dim=128, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    dense_pages = attn_tri.identity_pages(2, 4, table.shape[1], DEV)

    def step(plan):
        out, lse = plan.run(q, k, v, store, table, seq)
        d_out, d_lse = paged_decode(q, k, v, table, seq, dense_pages, backend="triton")
        return [t.clone() for t in (plan.pages, out, lse, d_out, d_lse)]

    monkeypatch.setattr(pdl, "ENABLED", False)
    base = step(DecodePlan(**kw))
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(DEV)
    plan = DecodePlan(**kw)
    eager = step(plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [plan.run(q, k, v, store, table, seq)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(base, eager):
        assert torch.equal(a, b)
    assert torch.equal(plan.pages, base[0])
    assert torch.equal(outs[0][0], base[1]) and torch.equal(outs[0][1], base[2])


def test_programmatic_dependent_launch_is_off_without_a_hopper_gpu(monkeypatch):
    from kvlocks import pdl

    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled("cpu") is False
    if CUDA and torch.cuda.get_device_capability() < (9, 0):
        assert pdl.enabled("cuda") is False


@pytest.mark.parametrize("value,expect", [("1", True), ("0", False), (" 0 ", False), ("true", None), ("", None)])
def test_programmatic_dependent_launch_switch_from_the_environment(value, expect, monkeypatch):
    """KVLOCKS_PDL: '1' (default) or '0'; anything else is refused with the allowed values, not read as off."""
    from kvlocks import pdl

    monkeypatch.setenv("KVLOCKS_PDL", value)
    if expect is None:
        with pytest.raises(ValueError, match="KVLOCKS_PDL=.*allowed '1'"):
            pdl._from_env()
    else:
        assert pdl._from_env() is expect
    monkeypatch.delenv("KVLOCKS_PDL")
    assert pdl._from_env() is True


def test_dense_tuner_checks_every_launch_and_keeps_the_fastest_correct_one(monkeypatch):
    """kvlocks.attention.tune: every candidate launch (pages per step, warps, stages, split count)
    computes the reference dense attention; the tuner returns the launch its timer says is fastest,
    and rejects a launch whose output differs from the default's even when it times fastest."""
    from kvlocks.attention import tune

    g, d, hkv = 4, 64, 2
    q, kc, vc, table, seq = make_paged(LENS["c"], hkv, g, d, BF16, seed=3)
    bsz = len(seq)
    dense = attn_tri.identity_pages(bsz, hkv, table.shape[1], DEV)
    shape = dict(batch=bsz, num_q_heads=hkv * g, head_dim=d, list_len=table.shape[1], rows=bsz * hkv,
                 dtype=q.dtype, device=DEV)
    for launch in tune.CANDIDATES:
        out, lse = attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=tune.workspace_for(launch, **shape))
        for b in range(bsz):
            n = int(seq[b])
            keys = kc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
            vals = vc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
            o, ref_lse = attn_ref.dense_decode(q[b].view(hkv, g, d), keys, vals)
            assert torch.allclose(out[b].float(), o.reshape(-1, d).float(), atol=2e-2, rtol=2e-2), launch
            assert torch.allclose(lse[b], ref_lse.reshape(-1), atol=1e-3), launch

    fast, wrong = tune.DenseLaunch(8, 4, 2, 2.0), tune.DenseLaunch(4, 8, 2, 0.5)
    real = tune.paged_decode

    def corrupting(*args, workspace, **kw):  # the `wrong` launch returns a shifted output
        out, lse = real(*args, workspace=workspace, **kw)
        if workspace["launch"] == {"num_warps": 8, "num_stages": 2} and workspace["ppi"] == 4:
            out = out + 1.0
        return out, lse

    monkeypatch.setattr(tune, "paged_decode", corrupting)
    calls = []

    def timer(run):  # seconds by launch: `wrong` fastest, then `fast`, the rest slower
        ws = run.__defaults__[0]
        calls.append(ws["splits"])
        key = (ws["ppi"], ws["launch"]["num_warps"], ws["launch"]["num_stages"])
        return {(4, 8, 2): 1e-6, (8, 4, 2): 2e-6}.get(key, 5e-6) + 1e-9 * ws["splits"]

    res = tune.fastest_dense(q, [kc], [vc], table, seq, dense, candidates=(fast, wrong, tune.DEFAULT),
                             timer=timer, rounds=3)
    assert res.launch == fast  # `wrong` timed faster but its output differs
    assert "output differs" in res.rejected[wrong.label()] and res.times_us[wrong.label()] is None
    assert res.times_us[fast.label()] == pytest.approx(2 + 1e-3 * res.workspace["splits"])
    assert len(calls) == 3 * 2  # rounds x the two launches that passed the check
    assert res.workspace["ppi"] == 8 and res.workspace["launch"] == {"num_warps": 4, "num_stages": 2}
    with pytest.raises(ValueError, match="candidates"):
        tune.fastest_dense(q, [kc], [vc], table, seq, dense, candidates=())
    if CUDA:  # the real timer: CUDA graphs of launches over the layers
        monkeypatch.setattr(tune, "paged_decode", real)
        res = tune.fastest_dense(q, [kc, kc], [vc, vc], table, seq, dense)
        assert not res.rejected and all(t > 0 for t in res.times_us.values())
        assert res.times_us[res.launch.label()] == min(res.times_us.values())
