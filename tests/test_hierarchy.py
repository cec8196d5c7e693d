"""Hierarchical scoring (``LocksConfig.group_pages``): group summaries choose the groups whose pages
are scored. Checked against flat LOCKS (every group kept), exact attention (budget covering the
context), the group's exact log-sum-exp (an unquantized full-rank group summary), and a planted
needle; the decode plan refuses it with the reason."""

from __future__ import annotations

import dataclasses

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
    flat = LocksConfig(budget=64, rank=4, rerank=0)
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


def _group_scores(gs, q, cfg):
    return score_pages_from_summaries(q, gs, scale=q.shape[-1] ** -0.5)


def test_the_store_builds_each_group_summary_once_as_its_pages_fill():
    """Incremental group summaries (prefill, one-token decode appends, truncate, batch reindex,
    fork) score exactly as summaries built from the stored keys at that moment."""
    from kvlocks.cache.paged import PagedLayerStore

    gen = torch.Generator().manual_seed(3)
    cfg = LocksConfig(budget=64, rank=4, group_pages=2, group_rank=6)  # groups of 32 keys
    store = PagedLayerStore(cfg, build=True)
    q = torch.randn(2, 2, 3, 32, generator=gen)  # [B, Hkv, G, D]

    def check():
        n = store.length
        assert store.groups.num_pages == n // 32
        assert torch.equal(_group_scores(store.groups, q, cfg), _group_scores(group_summaries(store.keys, cfg), q, cfg))

    store.append(torch.randn(2, 2, 75, 32, generator=gen), torch.randn(2, 2, 75, 32, generator=gen))
    check()
    built = store.groups
    for _ in range(40):  # the group [64, 96) fills at the 21st step; the others are never rebuilt
        store.append(torch.randn(2, 2, 1, 32, generator=gen), torch.randn(2, 2, 1, 32, generator=gen))
        check()
    assert torch.equal(store.groups.coef[..., :2, :, :], built.coef)
    store.truncate(70)
    check()
    store.index_batch(torch.tensor([1, 1, 0]))
    q = q[[1, 1, 0]]
    check()
    same = store.fork(cfg, build=True)
    assert same.groups is store.groups
    other = store.fork(dataclasses.replace(cfg, group_pages=4), build=True)  # groups of 64 keys, built from the keys
    assert other.groups.num_pages == 1 and other.summaries is store.summaries
    flat = store.fork(dataclasses.replace(cfg, group_pages=0), build=True)
    assert flat.groups is None


def test_hf_cache_reads_the_stores_group_summaries():
    """Decoding with the cache's incremental group summaries gives the same logits as building them
    from the keys at every step (the reference), and each group is summarised once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlocks.cache.paged import PagedLayerStore
    from kvlocks.integrations.hf import LocksCache, enable
    from kvlocks.integrations.hf.decode import prefill, step

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32)).eval()
    enable(model)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(4))
    cfg = LocksConfig(budget=48, rank=4, group_pages=2, group_keep=1)  # 9 full pages, 4 groups: 1 kept

    def run():
        cache = LocksCache(model.config, method="locks", config=cfg, backend="torch")
        logits = [prefill(model, cache, ids)]
        for _ in range(24):
            logits.append(step(model, cache, int(torch.argmax(logits[-1]))))
        return torch.stack([x.float() for x in logits]), cache

    kept, cache = run()
    assert all(layer.store.groups.num_pages == (150 + 24) // 32 for layer in cache.layers)
    original = PagedLayerStore._build_new_groups
    try:
        PagedLayerStore._build_new_groups = lambda self: None  # no stored groups: built from the keys
        rebuilt, cache = run()
    finally:
        PagedLayerStore._build_new_groups = original
    assert all(layer.store.groups is None for layer in cache.layers)
    torch.testing.assert_close(kept, rebuilt, rtol=0, atol=1e-5)
    # bytes: 174 tokens = 10 full pages in 5 full groups, 1 group kept (one free slot): the step reads
    # the 5 group summaries and the kept group's 2 page summaries, not the 10 page summaries
    from kvlocks.integrations.hf.stats import DecodeStats

    kept_cache = run()[1]
    store = kept_cache.layers[0].store
    page, group = sum(store.summaries.bytes_per_page()), sum(store.groups.bytes_per_page())
    kept_cache.stats = DecodeStats()
    kept_cache.record(0, store.keys, 3)
    assert kept_cache.stats.selection_bytes == 2 * (2 * page + 5 * group)  # Hkv = 2
    # int4 basis R*D/2, int8 coefficients S*R, int8 centroid D, float16 scales 2*(R + S + 1); D = 32
    assert (page, group) == (4 * 16 + 16 * 4 + 32 + 2 * 21, 8 * 16 + 32 * 8 + 32 + 2 * 41)  # pages R 4, groups R 8


def test_locks_hier_method_builds_its_config_and_runs_an_explicit_one_as_given():
    from transformers import LlamaConfig

    from kvlocks.config import method_config
    from kvlocks.integrations.hf import LocksCache, method_names
    from kvlocks.selection.hierarchy import DEFAULT_GROUPS, HIER_METHOD

    mc = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    assert HIER_METHOD in method_names()
    cache = LocksCache(mc, method=HIER_METHOD, config=method_config(HIER_METHOD, LocksConfig(budget=64)))
    assert (cache.config.group_pages, cache.config.group_keep, cache.config.budget) == (
        *DEFAULT_GROUPS.values(), 64)
    assert LocksCache(mc, method=HIER_METHOD).config.group_pages == DEFAULT_GROUPS["group_pages"]
    assert LocksCache(mc, method=HIER_METHOD, config=LocksConfig(group_pages=4)).config.group_pages == 4
    with pytest.raises(ValueError, match="method_config"):  # an explicit config is never rewritten
        LocksCache(mc, method=HIER_METHOD, config=LocksConfig(budget=64))
    fork = cache.fork()
    assert fork.method == HIER_METHOD and fork.config == cache.config
