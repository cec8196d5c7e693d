"""Triton decode kernels against the PyTorch references (the spec).

Without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set here before
any kernel module is imported; kernel modules are imported by nothing else on the CPU), at small
sizes. With a GPU the same tests run compiled, at larger sizes.
"""

import dataclasses
import os
import re

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvlocks.attention import reference as attn_ref  # noqa: E402
from kvlocks.attention import triton as attn_tri  # noqa: E402
from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import DENSE_LAUNCHES, DenseLaunch, KernelOptions, LocksConfig  # noqa: E402
from kvlocks.plan import (  # noqa: E402
    DecodePlan, paged_build, paged_build_new, paged_decode, paged_score, paged_select,
)
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
    Triton 3.6; ``seconds``: its time on the H200): GPU runs start it first (conftest)."""
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
    the 262,144-token cases took most of a GPU run's time limit on the CPU)."""
    store = SummaryStore.empty(k.shape[0], k.shape[2], k.shape[3], cfg, device=k.device)
    full = torch.cat([table[b, : int(seq[b]) // S] for b in range(len(seq))])
    paged_build(k, store, full, cfg, backend="torch")
    return store


@pytest.mark.parametrize("lens,g,d,dtype,rule", [
    ("a", 1, 64, F32, "mean_share"), ("b", 3, 128, BF16, "mean_share"), ("c", 4, 64, F16, "max_share"),
    ("d", 8, 128, F32, "sum_mass"), ("b", 16, 64, BF16, "mean_share"),
])
def test_score_matches_reference(lens, g, d, dtype, rule):
    cfg = LocksConfig(combine=rule)
    q, k, _, table, seq = make_paged(LENS[lens], 2, g, d, dtype)
    store = built_store(k, table, seq, cfg)
    got = paged_score(q, store, table, seq, combine=rule, backend="triton")
    exp = paged_score(q, store, table, seq, combine=rule, backend="torch")
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
    got = paged_score(q, store, table, seq, backend="triton")
    exp = paged_score(q, store, table, seq, backend="torch")
    _assert_scores_match(got, exp, seq)


@pytest.mark.parametrize("launch", [{"BLOCK": 8}, {"BLOCK": 32, "num_warps": 4}])
def test_score_kernel_step_sizes_agree(launch):
    """Every step size the autotuner may pick gives the reference's scores (16 is tested above)."""
    q, k, _, table, seq = make_paged(LENS["c"], 2, 3, 128, BF16)
    store = built_store(k, table, seq, LocksConfig())
    mma = KernelOptions(score_kernel="mma")  # the Triton three-dot kernel (on CUDA "auto" may pick the CUDA one)
    got = score_tri.score_pages_paged(q, store, table, seq, launch=launch, options=mma)
    exp = paged_score(q, store, table, seq, backend="torch")
    _assert_scores_match(got, exp, seq)


def test_score_kernel_choice_and_pins():
    """``KernelOptions.score_kernel``: "auto" takes the three-dot kernel off CUDA; a pinned kernel that
    cannot run these queries is refused with what it needs, never replaced by another."""
    from kvlocks.kernels_support import score_kernel

    q, k, _, table, seq = make_paged(LENS["b"], 2, 4, 64, F32)
    if not CUDA:
        assert score_kernel(q, 4, 8, 64) == "mma"
        with pytest.raises(ValueError, match="score kernel 'cuda' needs CUDA float16/bfloat16"):
            score_kernel(q, 4, 8, 64, choice="cuda")
    with pytest.raises(ValueError, match="score kernel 'packed' needs G in 1..16 and rank 8 or 16"):
        score_kernel(q, 4, 4, 64, choice="packed")
    with pytest.raises(ValueError, match="score kernel 'fast'"):
        score_kernel(q, 4, 8, 64, choice="fast")
    store = built_store(k, table, seq, LocksConfig())
    got = score_tri.score_pages_paged(q, store, table, seq, options=KernelOptions(score_kernel="packed"),
                                      launch={"BLOCK": 8})  # float32 queries: the portable unpacking
    _assert_scores_match(got, paged_score(q, store, table, seq, backend="torch"), seq)


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
    exp = paged_score(q, store, table, seq, backend="torch")
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
        exp = paged_score(qs, store, table, seq, backend="torch", scale=1.0 / factor)
        _assert_scores_match(got, exp, seq)


@pytest.mark.skipif(not CUDA, reason="inline PTX unpacking runs on CUDA only")
def test_packed_score_kernel_ptx_unpack_matches_reference():
    from kvlocks.kernels_support import score_kernel
    from kvlocks.scoring import triton_packed

    for g, d in ((1, 128), (2, 64), (3, 128), (4, 128), (8, 128), (16, 64)):
        q, k, _, table, seq = make_paged(LENS["b"], 2, g, d, BF16)
        store = built_store(k, table, seq, LocksConfig())
        # what score_pages runs on CUDA without the CUDA kernel
        assert score_kernel(q, g, 8, 64, cuda_library=lambda: False) == "packed"
        got = triton_packed.score_pages_packed(q, store, table, seq, unpack=2)
        exp = paged_score(q, store, table, seq, backend="torch")
        _assert_scores_match(got, exp, seq)


@pytest.mark.skipif(not CUDA, reason="CUDA kernel: needs a GPU")
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
    assert cuda_mma.available(q.device), cuda_mma.unavailable_reason(q.device)
    scale = 1.0 / (factor * d ** 0.5) if factor != 40.0 else None
    # default sizing; one tile per program (three of the four warps idle); warps whose tiles end
    # early; one program per row (several tiles per warp)
    for ppp in (None, 16, 48, 1 << 20):
        ws = None if ppp is None else score_tri.score_workspace(len(seq), 2, g, table.shape[1], q.device, ppp)
        got = cuda_mma.score_pages_mma(q, store, table, seq, scale=scale, workspace=ws)
        exp = paged_score(q, store, table, seq, backend="torch", scale=scale)
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


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("lens,k,sink,recent,ties,with_ss", SELECT_CASES)
def test_select_matches_reference(lens, k, sink, recent, ties, with_ss, narrow):
    """The two-launch selection, several chunks per row: the reference's pages. ``narrow`` rows
    exercise the rebased keys: one row whose keys share the sign, exponent and 12 mantissa bits,
    one constant row (every key equal: ties broken by index)."""
    _check_select(lens, k, sink, recent, ties, with_ss, narrow, chunk=32)


def test_select_merge_from_l2_matches_reference():
    """More chunk winners than one register tile holds (25 chunks x 256): the merge's radix passes
    re-read them from L2; the same pages as the reference."""
    _check_select([400 * S, 333 * S + 5], 200, 1, 2, True, True, True, chunk=16, regs=False)


def _check_select(lens, k, sink, recent, ties, with_ss, narrow, *, chunk, regs=None):
    gen = torch.Generator().manual_seed(k)
    bsz, hkv, max_pages = len(lens), 3, max(-(-n // S) for n in lens)
    ranking = torch.rand(bsz, hkv, max_pages, generator=gen)
    if ties:  # coarse values and many exact zeros (underflowed shares): ties broken by index
        ranking = (ranking * 3).floor() / 3
    if narrow:
        ranking[0, 0] = 0.5 + ranking[0, 0] * 2.0**-13
        ranking[-1, 1] = 0.25
    seq = torch.tensor(lens, dtype=torch.int32)
    ss = torch.randint(0, 4, (bsz,), generator=gen, dtype=torch.int32) if with_ss else None
    ws = sel_tri.select_workspace(bsz, hkv, max_pages, k, DEV, chunk=chunk)  # several chunks per row
    if regs is not None:  # the merge on one register tile, or from L2
        assert sel_tri.merge_meta(ws, k, sink, recent)["REGS"] == regs
    dv = [t.to(DEV) if t is not None else None for t in (ranking, seq, ss)]
    got = sel_tri.select_pages_paged(dv[0], dv[1], page_size=S, k=k, sink_pages=sink, recent_pages=recent,
                                     sink_start=dv[2], workspace=ws)
    exp = paged_select(dv[0], dv[1], page_size=S, k=k, sink_pages=sink, recent_pages=recent, sink_start=dv[2],
                       backend="torch")
    assert torch.equal(got.cpu(), exp.cpu())


def test_select_adapter_same_signature():
    r = torch.rand(2, 3, 25, device=DEV)
    for total, k in ((25, 4), (26, 2), (26, 40)):
        exp = select_top_pages(r, total, k)
        for page_size in (S, 8, 64):  # the pages chosen do not depend on the page size
            assert torch.equal(sel_tri.select_top_pages(r, total, k, page_size=page_size), exp)


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
    sel = dict(page_size=S, k=k, sink_pages=sink, recent_pages=recent, sink_start=ss)
    got = fused.rank_and_select(sw, seq, combine=rule, workspace=fw, **sel).clone()
    _, lse, ranking = paged_score(q, store, table, seq, combine=rule, backend="torch")
    for b, n in enumerate(LENS[lens]):
        pc = n // S
        assert torch.allclose(sw.ranking[b, :, :pc].cpu(), ranking[b, :, :pc].cpu(), rtol=1e-5, atol=1e-30)
        assert torch.allclose(sw.lse[b].cpu(), lse[b].cpu(), atol=1e-4) or pc == 0
    assert torch.equal(got.cpu(), paged_select(sw.ranking, seq, backend="torch", **sel).cpu())
    assert torch.equal(got.cpu(), paged_select(ranking, seq, backend="torch", **sel).cpu())
    assert int(fw.done.abs().sum()) == 0
    assert torch.equal(fused.rank_and_select(sw, seq, combine=rule, workspace=fw, **sel).cpu(), got.cpu())


def _tied_scores(bsz, hkv, g, pages, seed):
    """A score workspace holding hand-made per-head scores with many exact ties, and their
    statistics as one score program would leave them."""
    gen = torch.Generator().manual_seed(seed)
    sw = score_tri.score_workspace(bsz, hkv, g, pages, "cpu", pages_per_program=pages)
    scores = (torch.rand(bsz, hkv, g, pages, generator=gen) * 3).floor() - 40.0  # three levels per head
    sw.scores.copy_(scores)
    s2 = scores * score_tri.LOG2E
    m = s2.amax(-1)
    sw.stats.zero_()
    sw.stats[:, 0, 0, :g] = m.reshape(bsz * hkv, g)
    sw.stats[:, 0, 1, :g] = torch.exp2(s2 - m[..., None]).sum(-1).reshape(bsz * hkv, g)
    return dataclasses.replace(sw, **{f: getattr(sw, f).to(DEV) for f in ("scores", "stats", "lse", "ranking")})


@pytest.mark.parametrize("chunk", [16, 64, None])
def test_rank_and_select_breaks_ties_by_page_index(chunk):
    """Hand-made scores with many exact ties (and statistics of one score program): the fused
    kernel picks exactly what the reference selection picks from the same ranking (16 pages per
    program: 13 chunks of 16 winners, the merge on registers; 64: 4 chunks; None: one program)."""
    from kvlocks.selection import fused

    bsz, hkv, g, pages, k = 2, 3, 4, 200, 10
    seq = torch.tensor([pages * S, 150 * S + 7], dtype=torch.int32)
    sw = _tied_scores(bsz, hkv, g, pages, seed=11)
    fw = fused.fused_workspace(bsz, hkv, pages, k, DEV, chunk=chunk)
    got = fused.rank_and_select(sw, seq.to(DEV), page_size=S, k=k, workspace=fw)
    exp = paged_select(sw.ranking, seq.to(DEV), page_size=S, k=k, backend="torch")
    assert torch.equal(got.cpu(), exp.cpu())
    assert len(torch.unique(sw.ranking[0, 0])) <= 81  # ties are real: at most 3^4 distinct rankings


def test_short_rows_get_their_own_launch_and_the_same_pages():
    """``short_pages``: rows of at most 2,048 full pages are selected by a launch of 512 pages a
    program, longer rows by the plan's launch of 2,048; the pages equal one launch's and the
    reference selection's, for rows on both sides of the split, at it, and rows that fit the budget."""
    from kvlocks.selection import fused

    bsz, hkv, g, pages, k = 6, 1, 2, 6000, 40
    seq = torch.tensor([2048 * S, 2048 * S + S - 1, 2049 * S, 5000 * S + 3, 7 * S, 0], dtype=torch.int32)
    sw = _tied_scores(bsz, hkv, g, pages, seed=5)
    one = fused.fused_workspace(bsz, hkv, pages, k, DEV)
    split = fused.fused_workspace(bsz, hkv, pages, k, DEV, short_pages=2048)
    assert (one.chunk, one.short) == (2048, None)
    assert (split.chunk, split.short.chunk, split.short.n_chunks, split.short.out is split.out) == (2048, 512, 4, True)
    ref = fused.rank_and_select(sw, seq.to(DEV), page_size=S, k=k, workspace=one).clone()
    ranking = sw.ranking.clone()
    sw.ranking.fill_(float("nan"))
    got = fused.rank_and_select(sw, seq.to(DEV), page_size=S, k=k, workspace=split)
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(got.cpu(), paged_select(ranking, seq.to(DEV), page_size=S, k=k, backend="torch").cpu())
    for b, n in enumerate(seq.tolist()):  # each row's ranking written once, by its launch
        assert torch.equal(sw.ranking[b, :, : n // S].cpu(), ranking[b, :, : n // S].cpu())
    assert int(split.done.abs().sum()) == int(split.short.done.abs().sum()) == 0
    # no second launch where it would not differ, or for a plan no wider than the short rows
    assert fused.fused_workspace(bsz, hkv, 3000, k, DEV, short_pages=2048).short is None  # 512 a program in both
    assert fused.fused_workspace(bsz, hkv, pages, k, DEV, short_pages=pages).short is None
    with pytest.raises(ValueError, match="short_pages=-1: must be >= 0"):
        fused.fused_workspace(bsz, hkv, pages, k, DEV, short_pages=-1)


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


@pytest.mark.parametrize("lens,g,d,dtype,k", [
    ("a", 1, 64, F32, 2), ("b", 3, 128, BF16, 2), ("c", 4, 64, F16, 3), ("d", 8, 128, BF16, 5),
    ("c", 16, 128, F32, 64),
])
def test_attention_matches_reference(lens, g, d, dtype, k):
    """Split-KV decode over page lists and over every page, against the references; with one page
    per split, up to 7 splits, the same result again on a second launch of the same workspace."""
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
    # one page per split, up to 7 splits
    n_pages = table.shape[1]
    ws = attn_tri.attention_workspace(bsz, hkv * g, d, n_pages, bsz * hkv, q.dtype, DEV, launch=DenseLaunch(ppi=1),
                                      num_splits=min(7, n_pages))
    first = [t.clone() for t in attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=ws)]
    again = attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=ws)
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    assert torch.allclose(first[0].float(), got[0].float(), atol=tol, rtol=tol)
    assert torch.allclose(first[1], got[1], atol=1e-3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_writes_into_a_given_output(backend):
    """``out=``: the result lands in the caller's rows (a strided view of a larger buffer, as vLLM's
    output is), equal to the default buffer's, with nothing else touched; a mismatched ``out`` is refused."""
    q, kc, vc, table, seq = make_paged(LENS["c"], 2, 4, 64, BF16, seed=3)
    pl = torch.full((len(seq), 2, 5), -1, dtype=torch.int32)
    for b in range(len(seq)):  # the first pages of each row (at most 5)
        n = min(5, -(-int(seq[b]) // S))
        pl[b, :, :n] = torch.arange(n, dtype=torch.int32)
    pl = pl.to(DEV)
    exp = paged_decode(q, kc, vc, table, seq, pl, backend=backend)[0].clone()
    buf = torch.full((len(seq) + 3, q.shape[1], q.shape[2]), 7.0, dtype=q.dtype, device=DEV)
    out = buf[1 : 1 + len(seq)]
    got, _ = paged_decode(q, kc, vc, table, seq, pl, backend=backend, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, exp)
    assert bool((buf[0] == 7).all()) and bool((buf[1 + len(seq):] == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        paged_decode(q, kc, vc, table, seq, pl, backend=backend, out=out.float())


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


def page_keys(d: int, rank: int, pages: int) -> torch.Tensor:
    """float32 keys ``[2, pages, S, d]`` (seeded by d + rank): of full rank when ``rank`` is 0, else a
    per-page centroid plus a rank-``rank`` part, whose subspace is exact and unique."""
    gen = torch.Generator().manual_seed(d + rank)
    lead, p = (2,), pages
    if not rank:
        return torch.randn(*lead, p, S, d, generator=gen)
    return torch.randn(*lead, p, 1, d, generator=gen) + torch.randn(*lead, p, S, rank, generator=gen) @ \
        torch.randn(*lead, p, rank, d, generator=gen)


@pytest.mark.parametrize("solver", ["lean", _heavy(110, "onesided")])
@pytest.mark.parametrize("d,dtype,rank", [(64, F32, 0), (128, BF16, 0), (128, F32, 5), (64, F16, 12)])
def test_build_matches_reference(d, dtype, rank, solver):
    """Both build solvers against the float64 reference (keys of full rank, or of rank 5 and 12
    plus a centroid, whose subspace is exact and unique)."""
    keys = page_keys(d, rank, 3 if not CUDA else 500)
    keys = keys.to(dtype).to(DEV)
    cfg = LocksConfig()
    got = _cpu(build_tri.build_summaries(keys, cfg, solver=solver))
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


@pytest.mark.skipif(not CUDA, reason="a register cap is a CUDA compile option")
@pytest.mark.parametrize("solver", [_heavy(230, "onesided")])
def test_build_register_cap_changes_nothing(solver):
    """The one-sided bulk build's default launch caps the registers (``ONESIDED_LAUNCH``): that
    changes register allocation only, the summaries equal the uncapped launch's bit for bit."""
    _, k, _, _, _ = make_paged([64 * 1024], 8, 1, 128, BF16, seed=5)
    ids = torch.arange(k.shape[0], dtype=torch.int32, device=DEV)
    cfg = LocksConfig()
    stores = []
    for launch in ({"BP": 1, "num_warps": 1}, build_tri.ONESIDED_LAUNCH):
        store = SummaryStore.empty(k.shape[0], 8, 128, cfg, device=DEV)
        build_tri.build_pages(k, store, ids, launch=launch, solver=solver)
        stores.append(store)
    for name in ("basis", "basis_scale", "coef", "coef_scale", "centroid", "centroid_scale"):
        assert torch.equal(getattr(stores[0], name), getattr(stores[1], name)), name


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


@pytest.mark.parametrize("solver", ["lean", _heavy(46, "onesided")])
def test_incremental_build_builds_just_filled_pages(solver):
    """Both solvers (``KernelOptions.build_solver``; "auto": one-sided from Triton 3.9, lean before)
    in the decode-time launch."""
    cfg = LocksConfig()
    q, k, _, table, seq = make_paged([2 * S, 3 * S + 1, S - 1, S], 2, 1, 64, F32)
    store = SummaryStore.empty(k.shape[0], 2, 64, cfg, device=DEV)
    store.coef.fill_(99)
    paged_build_new(k, store, table, seq, cfg, backend="triton", options=KernelOptions(build_solver=solver))
    exp = SummaryStore.empty(k.shape[0], 2, 64, cfg, device=DEV)
    exp.coef.fill_(99)
    paged_build_new(k, exp, table, seq, cfg, backend="torch")
    touched = (exp.coef != 99).flatten(1).any(1)
    assert int(touched.sum()) == 2  # sequences 0 and 3 just filled a page
    assert torch.equal((store.coef != 99).flatten(1).any(1), touched)
    ids = touched.nonzero()[:, 0]
    # eigenvector signs are arbitrary: compare the (sign-free) quantized reconstructions
    assert float((_recon(store.gather(ids)) - _recon(exp.gather(ids))).abs().max()) < 1e-2


@pytest.mark.parametrize("lens,g,budget", [("c", 4, 64), ("d", 3, 32), ("b", 1, 2048)])
def test_decode_plan_matches_torch_backend(lens, g, budget):
    cfg = LocksConfig(budget=budget)
    q, k, v, table, seq = make_paged(LENS[lens], 2, g, 64, F32, seed=3)
    store = built_store(k, table, seq, cfg)
    kw = dict(batch=len(seq), num_kv_heads=2, group=g, head_dim=64, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    tri, ref = DecodePlan(backend="triton", **kw), DecodePlan(backend="torch", **kw)
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
def test_decode_step_with_programmatic_dependent_launch_is_unchanged():
    """``KernelOptions(pdl=True)``: the score kernel waits for the kernels ahead and triggers its
    dependents; the fused selection, the attention and its merge are launched early and wait; eager
    and graph-replayed steps give bit-for-bit the pages, outputs and LSEs of the same step without
    PDL, and so does the dense split-KV path."""
    from kvlocks import pdl

    cfg = LocksConfig(budget=2048)
    q, k, v, table, seq = make_paged([100_000, 40_000], 4, 4, 128, BF16, seed=5)
    store = built_store(k, table, seq, cfg)
    kw = dict(batch=2, num_kv_heads=4, group=4, head_dim=128, max_pages=table.shape[1], config=cfg,
              dtype=q.dtype, device=DEV)
    dense_pages = attn_tri.identity_pages(2, 4, table.shape[1], DEV)

    def step(plan):
        out, lse = plan.run(q, k, v, store, table, seq)
        d_out, d_lse = paged_decode(q, k, v, table, seq, dense_pages, backend="triton", options=plan.options)
        return [t.clone() for t in (plan.pages, out, lse, d_out, d_lse)]

    base = step(DecodePlan(**kw, options=KernelOptions(pdl=False)))
    assert pdl.enabled(DEV, True)
    plan = DecodePlan(**kw, options=KernelOptions(pdl=True))
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


def test_programmatic_dependent_launch_is_off_without_a_hopper_gpu():
    from kvlocks import pdl

    assert pdl.enabled("cpu", True) is False and pdl.enabled("cpu", False) is False
    if CUDA:
        assert pdl.enabled("cuda", False) is False
        if torch.cuda.get_device_capability() < (9, 0):
            assert pdl.enabled("cuda", True) is False


@pytest.mark.parametrize("value,expect", [("1", True), ("0", False), (" 0 ", False), ("true", None), ("", True)])
def test_programmatic_dependent_launch_default_from_the_environment(value, expect, monkeypatch):
    """KVLOCKS_PDL sets KernelOptions.pdl's default: '1' or '0' (unset or empty: '1'); anything else
    is refused with the allowed values, not read as off. An explicit value wins."""
    from kvlocks.config import default_kernel_options  # what options=None means, made once per value

    monkeypatch.setenv("KVLOCKS_PDL", value)
    if expect is None:
        with pytest.raises(ValueError, match="KVLOCKS_PDL='true': allowed '1' .* or '0'"):
            KernelOptions()
    else:
        assert KernelOptions().pdl is expect and default_kernel_options().pdl is expect
    assert KernelOptions(pdl=True).pdl is True
    monkeypatch.delenv("KVLOCKS_PDL")
    assert KernelOptions().pdl is True


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
    for launch in DENSE_LAUNCHES:
        out, lse = attn_tri.paged_decode(q, kc, vc, table, seq, dense, workspace=tune.workspace_for(launch, **shape))
        for b in range(bsz):
            n = int(seq[b])
            keys = kc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
            vals = vc[table[b, : -(-n // S)].long()].permute(2, 0, 1, 3).flatten(1, 2)[:, :n]
            o, ref_lse = attn_ref.dense_decode(q[b].view(hkv, g, d), keys, vals)
            assert torch.allclose(out[b].float(), o.reshape(-1, d).float(), atol=2e-2, rtol=2e-2), launch
            assert torch.allclose(lse[b], ref_lse.reshape(-1), atol=1e-3), launch

    fast, wrong = DenseLaunch(8, 4, 2, 2.0), DenseLaunch(4, 8, 2, 0.5)
    real = tune.paged_decode

    def corrupting(*args, workspace, **kw):  # the `wrong` launch returns a shifted output
        out, lse = real(*args, workspace=workspace, **kw)
        if workspace.launch == wrong:
            out = out + 1.0
        return out, lse

    monkeypatch.setattr(tune, "paged_decode", corrupting)
    calls = []

    def timer(run):  # seconds by launch: `wrong` fastest, then `fast`, the rest slower
        ws = run.__defaults__[0]
        calls.append(ws.splits)
        key = (ws.launch.ppi, ws.launch.num_warps, ws.launch.num_stages)
        return {(4, 8, 2): 1e-6, (8, 4, 2): 2e-6}.get(key, 5e-6) + 1e-9 * ws.splits

    res = tune.fastest_dense(q, [kc], [vc], table, seq, dense, candidates=(DenseLaunch(), fast, wrong),
                             timer=timer, rounds=3)
    assert res.launch == fast  # `wrong` timed faster but its output differs from the first launch's
    assert "output differs" in res.rejected[wrong.label()] and res.times_us[wrong.label()] is None
    assert res.times_us[fast.label()] == pytest.approx(2 + 1e-3 * res.workspace.splits)
    assert len(calls) == 3 * 2  # rounds x the two launches that passed the check
    assert res.workspace.launch == fast and res.default == DenseLaunch()
    with pytest.raises(ValueError, match="candidates"):
        tune.fastest_dense(q, [kc], [vc], table, seq, dense, candidates=())
    if CUDA:  # the real timer: CUDA graphs of launches over the layers
        monkeypatch.setattr(tune, "paged_decode", real)
        res = tune.fastest_dense(q, [kc, kc], [vc, vc], table, seq, dense)
        assert not res.rejected and all(t > 0 for t in res.times_us.values())
        assert res.times_us[res.launch.label()] == min(res.times_us.values())


SUPPORT_CASES = [  # (config, head_dim, reason on the torch backend, reason on the Triton kernels; None = supported)
    (LocksConfig(), 64, None, None),
    (LocksConfig(rank=16), 128, None, None),
    (LocksConfig(), 96, None, "head_dim=96: the Triton kernels support head_dim in (64, 128, 256)"),
    (LocksConfig(), 63, "head_dim=63: must be even", "head_dim=63: must be even"),
    (LocksConfig(page_size=32, budget=64), 128, None, "page_size=32: the Triton kernels support page_size=16 only"),
    (LocksConfig(rank=6), 64, None, "rank=6: the Triton kernels support ranks (1, 2, 4, 8, 16)"),
    (LocksConfig(basis_bits=8), 64, "basis_bits=4 and coef_bits=8 allowed, got basis_bits=8, coef_bits=8",
     "basis_bits=4 and coef_bits=8 allowed, got basis_bits=8"),
]


@pytest.mark.parametrize("cfg,d,torch_why,triton_why", SUPPORT_CASES)
def test_kernel_support_is_one_rule(cfg, d, torch_why, triton_why):
    """kvlocks.kernels_support.kernel_support is the one rule: the summary store, the decode plan on
    each backend, the paged build and the Hugging Face cache's kernel path all answer as it does
    (a ValueError with its reason, or, for the Hugging Face cache, the references as the fallback)."""
    from kvlocks.integrations.hf import kernel_path
    from kvlocks.kernels_support import kernel_support
    from kvlocks.selection.selectors import get_selector

    fields = dict(page_size=cfg.page_size, rank=cfg.rank, head_dim=d, basis_bits=cfg.basis_bits,
                  coef_bits=cfg.coef_bits)
    for backend, why in (("torch", torch_why), ("triton", triton_why)):
        got = kernel_support(**fields, backend=backend)
        assert (got is None) == (why is None) and (why is None or why in got), (backend, got)
        plan = dict(batch=1, num_kv_heads=1, group=2, head_dim=d, max_pages=4, config=cfg, dtype=F32, device=DEV,
                    backend=backend)
        k = torch.zeros(4, cfg.page_size, 1, d, device=DEV)
        if why is None:
            DecodePlan(**plan)
        else:
            with pytest.raises(ValueError, match=re.escape(why)):
                DecodePlan(**plan)
            with pytest.raises(ValueError, match=re.escape(why)):
                paged_build(k, None, torch.zeros(1, dtype=torch.int32, device=DEV), cfg, backend=backend)
    if torch_why is None:
        SummaryStore.empty(2, 1, d, cfg)
    else:
        with pytest.raises(ValueError, match="SummaryStore: .*" + re.escape(torch_why)):
            SummaryStore.empty(2, 1, d, cfg)
    assert kernel_path(get_selector("locks"), cfg, d) == (triton_why is None)
    # the oracle ranks pages its own way; the plan's kernels select and attend under the same rule
    assert kernel_path(get_selector("oracle"), cfg, d) == (triton_why is None)


def test_environment_is_read_through_one_table(monkeypatch):
    """Every KVLOCKS_* variable the library reads is a row of kvlocks.env's table and is read through
    it; a bad value of a 0/1 variable names the variable and what is allowed; unset, the default."""
    import re as _re
    from pathlib import Path

    import kvlocks
    from kvlocks import env

    src = Path(kvlocks.__file__).resolve().parents[1]  # src/: kvlocks and kvlocks_lab
    for path in src.rglob("*.py"):
        text = path.read_text()
        if path.name != "env.py":
            assert not _re.search(r"(environ\.get|getenv|environ\[)\(?\s*[\"']KVLOCKS_", text), path
        for name in _re.findall(r"env\.(?:get|flag)\(\s*[\"'](KVLOCKS_\w+)", text):
            assert name in env.VARIABLES, (path, name)
    for var in env.VARIABLES.values():
        assert var.meaning and var.allowed
    monkeypatch.setenv("KVLOCKS_VLLM_VERIFY", "yes")
    with pytest.raises(ValueError, match="KVLOCKS_VLLM_VERIFY='yes': allowed '1' or '0'"):
        env.flag("KVLOCKS_VLLM_VERIFY")
    monkeypatch.setenv("KVLOCKS_VLLM_VERIFY", "1")
    assert env.flag("KVLOCKS_VLLM_VERIFY") is True
    monkeypatch.delenv("KVLOCKS_CACHE", raising=False)
    assert env.get("KVLOCKS_CACHE") == "~/.cache/kvlocks"
    with pytest.raises(ValueError, match="'KVLOCKS_NOPE' is not a kvlocks environment variable"):
        env.get("KVLOCKS_NOPE")
