"""The row-histogram combine + selection (kvlocks.selection.row_radix) against the references.

Pages must be exactly :func:`kvlocks.dispatch.select_pages` (torch reference) of the combined
ranking, and the ranking / LSE the reference combine of the same per-head scores. On the CPU these
run through the Triton interpreter at small sizes; on a GPU at real ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import CUDA, DEV, LENS, S, built_store, make_paged  # first: sets TRITON_INTERPRET on the CPU

from kvlocks.config import LocksConfig
from kvlocks.dispatch import score_pages, select_pages
from kvlocks.scoring import triton as score_tri
from kvlocks.selection import fused, row_radix

LOG2E = 1.0 / math.log(2.0)


def scored_workspace(scores: torch.Tensor, lens: list[int], ppp: int = 16) -> dict:
    """A score workspace holding ``scores`` ``[B, Hkv, G, P]`` and the per-program (max, sum of exp2)
    statistics the score kernel would leave for them (programs of ``ppp`` pages, full pages only)."""
    bsz, hkv, g, p = scores.shape
    sw = score_tri.score_workspace(bsz, hkv, g, p, DEV, pages_per_program=ppp)
    sw["scores"].copy_(scores)
    st = sw["stats"]
    st.zero_()
    st[:, :, 0, :] = float("-inf")
    for b, n in enumerate(lens):
        pc = n // S
        for c in range(-(-pc // ppp)):
            s2 = scores[b, :, :, c * ppp: min((c + 1) * ppp, pc)] * LOG2E  # [Hkv, G, pages]
            m = s2.amax(-1)
            st[b * hkv: (b + 1) * hkv, c, 0, :g] = m
            st[b * hkv: (b + 1) * hkv, c, 1, :g] = torch.exp2(s2 - m[..., None]).sum(-1)
    return sw


def threshold_bin_size(ranking: torch.Tensor, lens: list[int], k: int, sink: int, recent: int) -> int:
    """Most candidates sharing the row histogram's threshold bin over the rows (what decides between
    the refine step's register tile and its loop over L2), computed here in torch."""
    most = 0
    for b, n in enumerate(lens):
        total, pc = -(-n // S), n // S
        if total <= k:
            continue
        forced = torch.zeros(pc, dtype=torch.bool)
        forced[:sink] = True
        forced[max(total - recent, 0):] = True
        for h in range(ranking.shape[1]):
            x = ranking[b, h, :pc].cpu()[~forced].contiguous()
            u = x.view(torch.int32).long() & 0xFFFFFFFF
            key = torch.where(u >= 2**31, (~u) & 0xFFFFFFFF, u | 2**31)
            bins = key >> (32 - row_radix.HIST_BITS)
            need = k - sink - recent
            kth = torch.sort(key, descending=True).values[need - 1] >> (32 - row_radix.HIST_BITS)
            most = max(most, int((bins == kth).sum()))
    return most


CASES = [  # (token counts, G, rule, pages per program, k, sink, recent, sink_start)
    ("e", 4, "mean_share", 64, 40, 1, 1, False), ("e", 3, "max_share", 32, 9, 2, 2, True),
    ("e", 8, "sum_mass", 16, 20, 1, 1, False), ("e", 1, "mean_share", 16, 128, 1, 1, False),
    ("e", 16, "mean_share", 128, 12, 1, 2, True), ("c", 2, "mean_share", 16, 6, 1, 1, False),
]


@pytest.mark.parametrize("lens,g,rule,chunk,k,sink,recent,with_ss", CASES)
def test_row_radix_matches_reference_and_fused(lens, g, rule, chunk, k, sink, recent, with_ss):
    """Real scores of built summaries: the ranking and LSE are the reference combine's, the pages the
    reference selection's and the fused kernel's; the row counters and histogram are left at zero,
    so a second call agrees."""
    cfg = LocksConfig(budget=64)
    q, k_, _, table, seq = make_paged(LENS[lens], 2, g, 64, torch.float32, seed=3)
    store = built_store(k_, table, seq, cfg)
    bsz, max_pages = len(seq), table.shape[1]
    ss = torch.tensor([1, 0, 2][:bsz], dtype=torch.int32, device=DEV) if with_ss else None
    sw = score_tri.score_workspace(bsz, 2, g, max_pages, DEV)
    score_tri.score_pages_paged(q, store, table, seq, combine=rule, workspace=sw, rank=False)
    sel = dict(page_size=S, k=k, sink_pages=sink, recent_pages=recent, sink_start=ss)
    rw = row_radix.row_radix_workspace(bsz, 2, max_pages, k, DEV, chunk=chunk)
    got = row_radix.rank_and_select_rows(sw, seq, combine=rule, workspace=rw, **sel).clone()
    _, lse, ranking = score_pages(q, store, table, seq, combine=rule, backend="torch")
    for b, n in enumerate(LENS[lens]):
        pc = n // S
        assert torch.allclose(sw["ranking"][b, :, :pc].cpu(), ranking[b, :, :pc].cpu(), rtol=1e-5, atol=1e-30)
        assert torch.allclose(sw["lse"][b].cpu(), lse[b].cpu(), atol=1e-4) or pc == 0
    assert torch.equal(got.cpu(), select_pages(sw["ranking"], seq, backend="torch", **sel).cpu())
    fw = fused.fused_workspace(bsz, 2, max_pages, k, DEV)
    assert torch.equal(got.cpu(), fused.rank_and_select(sw, seq, combine=rule, workspace=fw, **sel).cpu())
    assert int(rw["done"].abs().sum()) == 0 and int(rw["ccount"].abs().sum()) == 0
    assert int(rw["hist"].abs().sum()) == 0
    assert torch.equal(row_radix.rank_and_select_rows(sw, seq, combine=rule, workspace=rw, **sel).cpu(), got.cpu())


@pytest.mark.parametrize("tile", [None, 64])
@pytest.mark.parametrize("early,bits,rebase", [(True, 5, True), (False, 4, False)])
def test_row_radix_ties_and_a_crowded_threshold_bin(tile, early, bits, rebase):
    """Scores on a coarse grid: many exactly equal rankings, across chunks, at the threshold (ties go
    to the lower page) and many keys in the threshold bin; with ``tile`` = 64 the refine step takes
    its loop over L2 (checked: the bin holds more keys than the tile)."""
    lens = LENS["e"]
    gen = torch.Generator().manual_seed(11)
    bsz, hkv, g, k = len(lens), 2, 1, 40
    max_pages = -(-max(lens) // S) + 3
    scores = (torch.randint(0, 4, (bsz, hkv, g, max_pages), generator=gen).float() * 0.5).to(DEV)
    sw = scored_workspace(scores, lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sel = dict(page_size=S, k=k, sink_pages=1, recent_pages=1)
    rw = row_radix.row_radix_workspace(bsz, hkv, max_pages, k, DEV, chunk=32 if not CUDA else 1024)
    rw.update(tile=tile, early_exit=early, digit_bits=bits, rebase_keys=rebase)
    got = row_radix.rank_and_select_rows(sw, seq, workspace=rw, **sel).clone()
    ref = select_pages(sw["ranking"], seq, backend="torch", **sel)
    assert torch.equal(got.cpu(), ref.cpu())
    crowd = threshold_bin_size(sw["ranking"], lens, k, 1, 1)
    assert crowd > (tile or 0)
    ranking = sw["ranking"].cpu()
    row0 = ranking[0, 0, : lens[0] // S]
    assert len(torch.unique(row0)) <= 4  # heavily tied


def test_row_radix_short_rows_and_one_chunk():
    """Rows that fit the budget list every page (-1 padded), mixed with a long row, and a workspace of
    one chunk per row: the same pages as the reference."""
    lens = [5 * S + 3, 0, 200 * S]
    gen = torch.Generator().manual_seed(5)
    max_pages = 203
    scores = torch.randn(3, 2, 2, max_pages, generator=gen).to(DEV)
    sw = scored_workspace(scores, lens)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sel = dict(page_size=S, k=8, sink_pages=1, recent_pages=2)
    for chunk in (64, 256):
        rw = row_radix.row_radix_workspace(3, 2, max_pages, 8, DEV, chunk=chunk)
        got = row_radix.rank_and_select_rows(sw, seq, workspace=rw, **sel).clone()
        ref = select_pages(sw["ranking"], seq, backend="torch", **sel)
        assert torch.equal(got.cpu(), ref.cpu())
    assert got[0, 0].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert got[1, 0].tolist() == [-1] * 8


def test_row_radix_rejects_bad_workspace_and_arguments():
    sw = scored_workspace(torch.randn(1, 2, 2, 40).to(DEV), [640])
    seq = torch.tensor([640], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="power of two"):
        row_radix.row_radix_workspace(1, 2, 40, 8, DEV, chunk=48)
    with pytest.raises(ValueError, match="row_radix_workspace"):
        row_radix.rank_and_select_rows(sw, seq, page_size=S, k=8,
                                       workspace=fused.fused_workspace(1, 2, 40, 8, DEV))
    with pytest.raises(ValueError, match="row_radix_workspace"):
        row_radix.rank_and_select_rows(sw, seq, page_size=S, k=8,
                                       workspace=row_radix.row_radix_workspace(1, 2, 40, 6, DEV, chunk=16))
    with pytest.raises(ValueError, match="seq_lens"):
        row_radix.rank_and_select_rows(sw, seq.long(), page_size=S, k=8)
    with pytest.raises(ValueError, match="combine rule"):
        row_radix.rank_and_select_rows(sw, seq, page_size=S, k=8, combine="mean")
    with pytest.raises(ValueError, match="recent_pages"):
        row_radix.rank_and_select_rows(sw, seq, page_size=S, k=8, recent_pages=0)
