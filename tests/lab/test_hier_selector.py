"""Hierarchical scoring (the lab's ``locks_hier`` selector): group summaries choose the groups whose
pages are scored. Checked against flat LOCKS (every group kept), exact attention (a budget covering
the context), the group's exact log-sum-exp (an unquantized full-rank group summary), a planted
needle, and, through the Hugging Face cache, the decode plan against the token-major reference."""

from __future__ import annotations

import pytest
import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks.scoring.reference import score_pages_from_summaries
from kvlocks.selection.selectors import LayerView, LocksSelector, OracleSelector, choose_pages, get_selector
from kvlocks.summary.build import build_summaries
from kvlocks_lab.selectors.hier import Groups, HierSelector, group_summaries, hierarchical_page_scores, hierarchical_ranking

S = 16


def test_groups_validate_and_size_their_summaries():
    cfg = LocksConfig(budget=64)  # k = 4: two free slots
    g = Groups(pages=4, keep=2)
    assert g.kept(cfg, 10) == 4 and g.kept(cfg, 3) == 3
    assert (g.config(cfg).page_size, g.config(cfg).rank) == (64, 8)
    for kw, needle in (({"pages": 1}, "pages=1"), ({"pages": 300}, "pages=300"), ({"keep": 0}, "keep=0"),
                       ({"rank": True}, "rank=True")):
        with pytest.raises(ValueError, match=needle):
            Groups(**kw)
    with pytest.raises(ValueError, match="exceeds 4096"):
        Groups(pages=8).config(LocksConfig(page_size=1024, budget=2048))
    with pytest.raises(ValueError, match="rank=33: allowed 1..32"):
        Groups(pages=2, rank=33).config(cfg)


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
    view = _view(keys, flat)
    every = HierSelector(Groups(pages=4, keep=8))  # 2 free slots x 8 >= 6 groups
    assert torch.equal(choose_pages(q, view, flat, every), choose_pages(q, view, flat, LocksSelector()))
    wide = LocksConfig(budget=16 * 28, rank=4, rerank=0)
    assert choose_pages(q, view, wide, HierSelector(Groups(pages=4, keep=1))).tolist() == [list(range(-(-n // S)))] * 2


def test_full_rank_unquantized_group_summary_scores_the_group_exactly():
    gen = torch.Generator().manual_seed(1)
    keys, q = torch.randn(1, 16 * 8, 16, generator=gen), torch.randn(1, 2, 16, generator=gen)
    cfg = LocksConfig(budget=64, rank=4, basis_bits=16, coef_bits=16)
    gs = group_summaries(keys, cfg, Groups(pages=4, rank=16))  # 2 groups of 64 keys, rank 16 = the head dim
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
    cfg, groups = LocksConfig(budget=48, rank=4, rerank=0), Groups(pages=4, keep=1)  # k = 3: one group kept
    view = _view(keys, cfg)
    pages, gscores = hierarchical_page_scores(q, keys, view.summaries, cfg, groups, scale=d ** -0.5)
    ranking, read = hierarchical_ranking(pages, gscores, cfg, groups)
    assert torch.isfinite(ranking[0, 16:20]).all() and torch.isneginf(ranking[0, :16]).all()
    assert torch.isneginf(read[0, 0, 20:]).all()  # the pages of the other groups were never read
    assert choose_pages(q, view, cfg, HierSelector(groups))[0].tolist() == [0, 19, 31]
    assert choose_pages(q, view, cfg, OracleSelector())[0].tolist() == [0, 19, 31]


@pytest.mark.parametrize("n", [16 * 24, 16 * 27 + 5])
def test_groups_then_pages_then_the_exact_rerank_compose(n):
    """coarse groups -> page summaries -> exact re-rank: with every group kept and candidates covering
    every page, the three stages give the exact oracle's selection; with one group kept per free
    slot, the re-rank only chooses among the kept groups' pages (and the forced ones)."""
    gen = torch.Generator().manual_seed(3)
    keys, q = torch.randn(2, n, 32, generator=gen), torch.randn(2, 3, 32, generator=gen) * 2
    view = _view(keys, LocksConfig(budget=64, rank=4))
    every = LocksConfig(budget=64, rank=4, rerank=32)
    oracle = choose_pages(q, view, LocksConfig(budget=64, rank=4), OracleSelector())
    assert torch.equal(choose_pages(q, view, every, HierSelector(Groups(pages=4, keep=8))), oracle)
    tight, groups = LocksConfig(budget=64, rank=4, rerank=4), Groups(pages=4, keep=1)
    pages, gscores = hierarchical_page_scores(q, keys, view.summaries, tight, groups, scale=32 ** -0.5)
    _, read = hierarchical_ranking(pages, gscores, tight, groups)
    scored = torch.isfinite(read).any(dim=-2)  # [Hkv, Pc] pages whose summaries were read
    total = -(-n // S)
    for h, row in enumerate(choose_pages(q, view, tight, HierSelector(groups)).tolist()):
        free = [p for p in row if p not in (0, total - 1)]
        assert all(bool(scored[h, p]) for p in free), (h, row)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32)).eval()


def test_hf_cache_runs_the_selector_on_the_plan_as_the_reference_does():
    """``LocksCache(method="locks_hier")`` decodes through the decode plan (the selector ranks, the
    plan selects and attends) with the logits of the token-major reference; the byte accounting
    counts every group summary and the kept groups' page summaries."""
    from kvlocks.integrations.hf import LocksCache, enable, method_names
    from kvlocks.integrations.hf.decode import prefill, step
    from kvlocks.integrations.hf.stats import DecodeStats

    model = _tiny_llama()
    enable(model)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(4))
    cfg = LocksConfig(budget=48, rank=4, rerank=0)  # 9 full pages at the prompt's end: 4 groups, 1 kept
    selector = HierSelector(Groups(pages=2, keep=1))

    def run(backend):
        cache = LocksCache(model.config, method=selector, config=cfg, backend=backend)
        logits = [prefill(model, cache, ids)]
        for _ in range(24):
            logits.append(step(model, cache, int(torch.argmax(logits[-1]))))
        return torch.stack([x.float() for x in logits]), cache

    plan, cache = run(None)
    assert cache.plan_backend(cache.layers[0].store.keys) == "cpu"
    reference, _ = run("torch")
    torch.testing.assert_close(plan, reference, rtol=0, atol=1e-5)
    # 174 tokens = 10 full pages in 5 full groups, 1 group kept (one free slot): the step reads the
    # 5 group summaries and the kept group's 2 page summaries, not the 10 page summaries
    store = cache.layers[0].store
    cache.stats = DecodeStats()
    cache.record(0, store.keys, 3)
    # int4 basis R*D/2, int8 coefficients S*R, int8 centroid D, float16 scales 2*(R + S + 1); D = 32
    page, group = 4 * 16 + 16 * 4 + 32 + 2 * 21, 8 * 16 + 32 * 8 + 32 + 2 * 41  # pages R 4, groups R 8
    assert cache.stats.selection_bytes == 2 * (2 * page + 5 * group)  # Hkv = 2
    assert "locks_hier" in method_names() and isinstance(get_selector("locks_hier"), HierSelector)
    assert method_config("locks_hier", LocksConfig(budget=64)).rerank == 0  # a baseline: no default re-rank


def test_a_layers_group_summaries_are_built_once_and_again_only_when_their_keys_change():
    """The selector keeps a layer's group summaries: over appended keys, a changed early key and a
    new batch shape its rankings equal a fresh selector's, which builds every group from the keys."""
    gen = torch.Generator().manual_seed(5)
    d, g = 32, 2
    keys, q = torch.randn(2, 2, 16 * 40, d, generator=gen), torch.randn(2, 2, g, d, generator=gen)
    cfg, groups = LocksConfig(budget=48, rank=4, rerank=0), Groups(pages=4, keep=1)
    kept = HierSelector(groups)
    steps = ((16 * 3, None), (16 * 17, None), (16 * 25 + 3, None), (16 * 33, None), (16 * 33, 70), (16 * 40, None))
    for n, change in steps:  # the first has no full group yet
        k = keys[..., :n, :].clone()
        if change is not None:
            keys[1, 0, change] += 1.0  # group 1 of row (1, 0): it and every later group are built again
            k = keys[..., :n, :].clone()
        view = LayerView(keys=k, summaries=build_summaries(k[..., : n // S * S, :].unflatten(-2, (n // S, S)), cfg),
                         token_mask=None, scale=d ** -0.5, layer=3)
        for got, want in zip(kept.rank_pages(q, view, cfg), HierSelector(groups).rank_pages(q, view, cfg)):
            assert torch.equal(got, want), n
    one = LayerView(keys=k[:1], summaries=view.summaries.index_lead(torch.tensor([0])), token_mask=None,
                    scale=d ** -0.5, layer=3)
    for got, want in zip(kept.rank_pages(q[:1], one, cfg), HierSelector(groups).rank_pages(q[:1], one, cfg)):
        assert torch.equal(got, want)
