"""Hierarchical scoring (``LocksConfig.group_pages``): group summaries choose the groups whose pages
are scored. Checked against flat LOCKS (every group kept), exact attention (budget covering the
context), the group's exact log-sum-exp (an unquantized full-rank group summary), and a planted
needle; the decode plan refuses it with the reason."""

from __future__ import annotations

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.hierarchy import group_config, group_summaries, hierarchical_page_scores, hierarchical_ranking
from kvlocks.selection.selectors import LayerView, LocksSelector, OracleSelector, choose_pages
from kvlocks.summary.build import build_summaries
from kvlocks.scoring.reference import score_pages_from_summaries

S = 16


def test_config_validates_the_hierarchy():
    cfg = LocksConfig(budget=64, group_pages=4, group_keep=2)
    assert cfg.groups_kept(10) == 4 and cfg.groups_kept(3) == 3 and LocksConfig().groups_kept(10) == 0
    assert group_config(cfg).page_size == 64 and group_config(cfg).rank == 8
    for kw, needle in (({"group_pages": 1}, "group_pages=1"), ({"group_pages": 300}, "group_pages=300"),
                       ({"group_pages": 8, "page_size": 1024, "budget": 2048}, "exceeds 4096"),
                       ({"group_pages": 2, "group_rank": 33}, "group_rank=33"), ({"group_keep": 0}, "group_keep=0")):
        with pytest.raises(ValueError, match=needle):
            LocksConfig(**kw)


def _view(keys, cfg):
    hkv, n, d = keys.shape
    pc = n // S
    summ = build_summaries(keys[:, : pc * S].reshape(hkv, pc, S, d), cfg)
    return LayerView(keys=keys, summaries=summ, token_mask=None, scale=d ** -0.5)


@pytest.mark.parametrize("n", [16 * 24, 16 * 27 + 5])
def test_every_group_kept_is_flat_locks_and_a_covering_budget_is_every_page(n):
    gen = torch.Generator().manual_seed(0)
    keys, q = torch.randn(2, n, 32, generator=gen), torch.randn(2, 3, 32, generator=gen)
    flat = LocksConfig(budget=64, rank=4)
    hier = LocksConfig(budget=64, rank=4, group_pages=4, group_keep=8)  # 2 free slots x 8 >= 6 groups
    view = _view(keys, flat)
    assert torch.equal(choose_pages(q, view, hier, LocksSelector()), choose_pages(q, view, flat, LocksSelector()))
    wide = LocksConfig(budget=16 * 28, rank=4, group_pages=4, group_keep=1)
    assert choose_pages(q, view, wide, LocksSelector()).tolist() == [list(range(-(-n // S)))] * 2


def test_full_rank_unquantized_group_summary_scores_the_group_exactly():
    gen = torch.Generator().manual_seed(1)
    keys, q = torch.randn(1, 16 * 8, 16, generator=gen), torch.randn(1, 2, 16, generator=gen)
    cfg = LocksConfig(budget=64, rank=4, group_pages=4, group_rank=16, basis_bits=16, coef_bits=16)
    gs = group_summaries(keys, cfg)  # 2 groups of 64 keys, rank 16 = the head dim: no tail
    got = score_pages_from_summaries(q, gs, scale=0.25)  # [1, 2, 2]
    exact = torch.logsumexp(torch.einsum("hgd,hnd->hgn", q, keys).unflatten(-1, (2, 64)) * 0.25, dim=-1)
    torch.testing.assert_close(got, exact, atol=2e-2, rtol=0)  # float16 storage only


def test_the_group_holding_a_needle_is_kept_and_its_page_selected():
    gen = torch.Generator().manual_seed(2)
    d, n = 32, 16 * 32  # 32 pages, 8 groups of 4
    keys = torch.randn(1, n, d, generator=gen) * 0.3
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 4.0
    needle = 19 * S + 5  # page 19, group 4
    keys[0, needle] = 0.0
    keys[0, needle, 0] = 6.0
    cfg = LocksConfig(budget=48, rank=4, group_pages=4, group_keep=1)  # k = 3: one free slot, one group kept
    view = _view(keys, cfg)
    pages, groups = hierarchical_page_scores(q, keys, view.summaries, cfg, scale=d ** -0.5)
    ranking, read = hierarchical_ranking(pages, groups, cfg)
    assert torch.isfinite(ranking[0, 16:20]).all() and torch.isneginf(ranking[0, :16]).all()
    assert torch.isneginf(read[0, 0, 20:]).all()  # the pages of the other groups were never read
    assert choose_pages(q, view, cfg, LocksSelector())[0].tolist() == [0, 19, 31]
    assert choose_pages(q, view, cfg, OracleSelector())[0].tolist() == [0, 19, 31]


@pytest.mark.parametrize("n", [16 * 24, 16 * 27 + 5])
def test_groups_then_pages_then_the_exact_rerank_compose(n):
    """coarse groups -> page summaries -> exact re-rank: with every group kept and candidates covering
    every page, the three stages give the exact oracle's selection; with one group kept per free
    slot, the re-rank only chooses among the kept groups' pages (and the forced ones)."""
    gen = torch.Generator().manual_seed(3)
    keys, q = torch.randn(2, n, 32, generator=gen), torch.randn(2, 3, 32, generator=gen) * 2
    view = _view(keys, LocksConfig(budget=64, rank=4))
    every = LocksConfig(budget=64, rank=4, group_pages=4, group_keep=8, rerank=32)
    oracle = choose_pages(q, view, LocksConfig(budget=64, rank=4), OracleSelector())
    assert torch.equal(choose_pages(q, view, every, LocksSelector()), oracle)
    tight = LocksConfig(budget=64, rank=4, group_pages=4, group_keep=1, rerank=4)
    pages, groups = hierarchical_page_scores(q, keys, view.summaries, tight, scale=32 ** -0.5)
    _, read = hierarchical_ranking(pages, groups, tight)
    scored = torch.isfinite(read).any(dim=-2)  # [Hkv, Pc] pages whose summaries were read
    total = -(-n // S)
    for h, row in enumerate(choose_pages(q, view, tight, LocksSelector()).tolist()):
        free = [p for p in row if p not in (0, total - 1)]
        assert all(bool(scored[h, p]) for p in free), (h, row)


def test_the_decode_plan_refuses_hierarchical_scoring():
    from kvlocks.plan import DecodePlan

    with pytest.raises(ValueError, match="group_pages=4: hierarchical scoring runs on the references only"):
        DecodePlan(batch=1, num_kv_heads=1, group=1, head_dim=64, max_pages=8, device="cpu", dtype=torch.float32,
                   config=LocksConfig(budget=64, group_pages=4), backend="torch")
