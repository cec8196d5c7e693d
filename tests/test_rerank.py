"""Two-stage selection (``LocksConfig.rerank``): the summaries' candidates re-ranked by their exact
page masses. Checked against the exact oracle (candidates covering every page), a planted needle
(inside and outside the candidate cut), and the paged path (torch and Triton backends) against
the token-major reference row by row."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlocks.cache.layout import SummaryStore, paged_to_token_major  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build  # noqa: E402
from kvlocks.scoring.reference import combine_group  # noqa: E402
from kvlocks.selection.rerank import rerank_ranking  # noqa: E402
from kvlocks.selection.selectors import LayerView, LocksSelector, OracleSelector, choose_pages  # noqa: E402
from kvlocks.selection.topk import select_top_pages  # noqa: E402
from kvlocks.summary.build import build_summaries  # noqa: E402

S = 16
DEFAULT_RERANK_MULT = 4  # locks_rerank's candidate multiple (METHOD_MODES)


def test_config_validates_rerank():
    assert LocksConfig(rerank=0).rerank == 0 and LocksConfig(rerank=4).rerank == 4
    for bad in (1, -1, 65, True, 2.0, "on"):
        with pytest.raises(ValueError, match="LocksConfig.rerank=.*0 \\(off\\), an integer in 2..64 or 'auto'"):
            LocksConfig(rerank=bad)
    cfg = LocksConfig(budget=64, rerank=4)  # k = 4, two free slots -> 8 candidates
    assert cfg.rerank_candidates(100) == 8 and cfg.rerank_candidates(5) == 5 and LocksConfig(rerank=0).rerank_candidates(9) == 0
    assert LocksConfig.from_json(cfg.to_json()) == cfg
    floor = LocksConfig(budget=64, rerank=4, rerank_min=30)  # at least 30 candidates, never more than the pages
    assert floor.rerank_candidates(100) == 30 and floor.rerank_candidates(20) == 20
    assert LocksConfig(budget=64, rerank=4, rerank_min=5).rerank_candidates(100) == 8
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="LocksConfig.rerank_min"):
            LocksConfig(rerank=4, rerank_min=bad)


def _view(keys, cfg, token_mask=None):
    hkv, n, d = keys.shape
    pc = n // S
    summ = build_summaries(keys[:, : pc * S].reshape(hkv, pc, S, d), cfg)
    return LayerView(keys=keys, summaries=summ, token_mask=token_mask, scale=d ** -0.5)


@pytest.mark.parametrize("rule", ["mean_share", "max_share", "sum_mass"])
@pytest.mark.parametrize("n", [16 * 21, 16 * 21 + 7])
def test_candidates_covering_every_page_give_the_oracle_selection(rule, n):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, n, 32, generator=gen)
    q = torch.randn(2, 3, 32, generator=gen) * 2
    cfg = LocksConfig(budget=64, combine=rule, rank=4, rerank=64)  # 128 candidates >= 21 pages
    view = _view(keys, cfg)
    got = choose_pages(q, view, cfg, LocksSelector())
    assert torch.equal(got, choose_pages(q, view, cfg, OracleSelector()))
    # and left padding (a token mask) moves the sink page the same way for both
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[:, :40] = False
    view = _view(keys, cfg, mask)
    assert torch.equal(choose_pages(q, view, cfg, LocksSelector()), choose_pages(q, view, cfg, OracleSelector()))


def test_a_needle_inside_the_candidates_is_chosen_and_one_outside_is_not():
    """Hand-made estimates that rank the needle's page 6th of 10 free pages; k = 4 (2 free slots):
    with 6 or more candidates (rerank=3) the exact mass finds it, with 4 (rerank=2) it stays out."""
    d, pc = 8, 12
    keys = torch.zeros(1, pc * S, d)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    needle = 7
    keys[0, needle * S + 3, 0] = 40.0  # one token with logit 40 * scale
    est = torch.zeros(1, 1, pc)
    est[0, 0, :] = torch.tensor([9.0, 5.0, 4.9, 4.8, 4.7, 4.6, 1.0, 4.5, 1.0, 1.0, 1.0, 9.0])  # needle page: 4.5
    ranking = combine_group(est, "mean_share")
    for rerank, found in ((3, True), (2, False)):
        cfg = LocksConfig(budget=64, rerank=rerank)
        final = rerank_ranking(q, keys, est, ranking, cfg, scale=1.0, total_pages=pc)
        pages = select_top_pages(final, pc, cfg.pages_per_step)[0].tolist()
        assert (needle in pages) == found, (rerank, pages)
        assert pages[0] == 0 and pages[-1] == pc - 1  # sink and recent kept
        cand = torch.isfinite(final[0]).nonzero().flatten().tolist()
        assert len(cand) == cfg.rerank_candidates(pc) and 0 not in cand and pc - 1 not in cand


def _paged_case(lens, hkv, g, d, cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, p in enumerate(need):
        table[b, :p] = perm[at: at + p].to(torch.int32)
        at += p
    k = torch.randn(nb, S, hkv, d, generator=gen)
    v = torch.randn(nb, S, hkv, d, generator=gen)
    q = torch.randn(len(lens), hkv * g, d, generator=gen) * 2
    store = SummaryStore.empty(nb, hkv, d, cfg, device="cpu")
    full = torch.cat([table[b, : n // S] for b, n in enumerate(lens)])
    paged_build(k, store, full, cfg, backend="torch")
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32), store


@pytest.mark.parametrize("backend,rule", [("torch", "mean_share"), ("triton", "mean_share"),
                                          ("triton", "max_share"), ("triton", "sum_mass")])
def test_paged_rerank_selects_the_reference_pages_row_by_row(backend, rule):
    """Rows of 3 to 40 pages (full and partial last pages), k = 4, 8 candidates: the plan's pages
    equal the token-major reference's (summaries built the same way, read back from the store).
    Triton: the fused selection picks the 10 candidates, the re-rank works on those only and
    rebuilds the combine's normalisers from the per-head log-sum-exp."""
    hkv, g, d = 2, 3, 64
    cfg = LocksConfig(budget=64, rerank=4, combine=rule)
    lens = [40 * S, 23 * S + 5, 3 * S + 1, 9 * S]
    q, k, v, table, seq, store = _paged_case(lens, hkv, g, d, cfg)
    plan = DecodePlan(batch=len(lens), num_kv_heads=hkv, group=g, head_dim=d, max_pages=table.shape[1], config=cfg,
                      dtype=torch.float32, device="cpu", backend=backend)
    plan.run(q, k, v, store, table, seq)
    for b, n in enumerate(lens):
        keys = paged_to_token_major(k, table[b], n)  # [Hkv, n, D]
        summ = store.gather(table[b, : n // S])
        view = LayerView(keys=keys, summaries=summ, token_mask=None, scale=d ** -0.5)
        want = choose_pages(q[b].view(hkv, g, d), view, cfg, LocksSelector())  # [Hkv, K]
        assert plan.pages[b, :, : want.shape[-1]].tolist() == want.tolist(), (b, n)
    # without the re-rank the plan keeps its own selection, and the two differ somewhere
    plain = DecodePlan(batch=len(lens), num_kv_heads=hkv, group=g, head_dim=d, max_pages=table.shape[1],
                       config=LocksConfig(budget=64, combine=rule, rerank=0), dtype=torch.float32, device="cpu",
                       backend=backend)
    reranked = plan.pages.clone()
    plain.run(q, k, v, store, table, seq)
    assert not torch.equal(plain.pages, reranked)


def test_hf_cache_with_full_coverage_rerank_decodes_as_the_oracle_and_counts_key_bytes():
    """A small random Llama (fp32, CPU path): LOCKS with candidates covering every page gives the
    oracle's logits at every step, and its selection bytes add the candidates' keys."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlocks.integrations.hf import LocksCache, enable
    from kvlocks.integrations.hf.decode import prefill, step

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, method, lcfg in (("rerank", "locks", LocksConfig(budget=48, rank=4, rerank=64)),
                               ("oracle", "oracle", LocksConfig(budget=48, rank=4, rerank=0)),
                               ("locks", "locks", LocksConfig(budget=48, rank=4, rerank=0))):
        cache = LocksCache(model.config, method=method, config=lcfg)
        logits, token = [prefill(model, cache, ids)], None
        for _ in range(4):
            token = int(torch.argmax(logits[-1]))
            logits.append(step(model, cache, token))
        runs[name] = (torch.stack([x.float() for x in logits]), cache.stats.summary())
    torch.testing.assert_close(runs["rerank"][0], runs["oracle"][0], rtol=1e-5, atol=1e-5)
    sel = {k: v[1]["selection_bytes"] for k, v in runs.items()}
    # per (layer, step): the summaries plus the keys of every full page (9 pages of 16 tokens at
    # contexts 151-154; the candidates cover them): 2 KV heads x 144 tokens x 32 dims x 4 bytes
    assert sel["rerank"] - sel["locks"] == 2 * 144 * 32 * 4


def test_locks_rerank_method_builds_its_config_and_runs_an_explicit_one_as_given():
    from transformers import LlamaConfig

    from kvlocks.config import method_config
    from kvlocks.integrations.hf import DEFAULT_RERANK, LocksCache, method_names

    mc = LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=64)
    assert "locks_rerank" in method_names()
    cache = LocksCache(mc, method="locks_rerank", config=method_config("locks_rerank", LocksConfig(budget=64)))
    assert isinstance(cache.selector, LocksSelector) and cache.config.rerank == DEFAULT_RERANK
    assert LocksCache(mc, method="locks_rerank").config.rerank == DEFAULT_RERANK
    assert LocksCache(mc, method="locks_rerank", config=LocksConfig(rerank=8)).config.rerank == 8
    with pytest.raises(ValueError, match="method_config"):  # an explicit config is never rewritten
        LocksCache(mc, method="locks_rerank", config=LocksConfig(budget=64, rerank=0))
    fork = cache.fork()
    assert fork.method == "locks_rerank" and fork.config.rerank == DEFAULT_RERANK
    assert cache.fork(method="locks", config=LocksConfig(budget=64, rerank=0)).config.rerank == 0
    assert LocksCache(mc, method="locks_flat").config.rerank == 0


def test_default_rule_reranks_below_thirty_free_pages_and_an_explicit_value_wins():
    """rerank="auto" (the default): 4 while k - sink - recent < 30, else 0; explicit values kept;
    replace() chooses again for new fields; JSON carries the value chosen; baselines and
    locks_flat run flat unless the config sets the re-rank."""
    from kvlocks.config import AUTO_RERANK_BELOW_FREE_PAGES, AUTO_RERANK_MULTIPLE, method_config

    for budget in range(32, 1025, 16):
        free = budget // S - 2
        cfg = LocksConfig(budget=budget)
        want = AUTO_RERANK_MULTIPLE if 0 < free < AUTO_RERANK_BELOW_FREE_PAGES else 0  # k = 2: no free slot
        assert cfg.rerank_auto and cfg.rerank == want
        assert cfg.selection() == ("rerank" if cfg.rerank else "flat")
    assert (LocksConfig(budget=496).rerank, LocksConfig(budget=512).rerank) == (4, 0)  # 29 / 30 free pages
    assert LocksConfig(budget=512, sink_pages=2).rerank == 4  # 29 free
    explicit = LocksConfig(budget=128, rerank=0)
    assert not explicit.rerank_auto and explicit.rerank == 0 and explicit.replace(budget=2048).rerank == 0
    assert LocksConfig(budget=2048, rerank=8).rerank == 8
    auto = LocksConfig(budget=128)
    assert auto.replace(budget=2048).rerank == 0 and auto.replace(budget=2048).rerank_auto
    assert auto.replace(rerank=0).rerank == 0
    assert LocksConfig.from_json(auto.to_json()) == auto and '"rerank": 4' in auto.to_json()
    assert LocksConfig.from_json('{"budget": 128}').rerank == 4
    assert method_config("locks", auto).rerank == 4
    assert method_config("locks_flat", auto).rerank == 0 and method_config("quest", auto).rerank == 0
    assert method_config("quest", LocksConfig(budget=128, rerank=8)).rerank == 8  # set: kept
    assert method_config("locks_rerank", LocksConfig(budget=2048)).rerank == DEFAULT_RERANK_MULT
    with pytest.raises(ValueError, match="set rerank explicitly"):
        LocksConfig(rerank_scores="centroid")


@pytest.mark.parametrize("g,rule,dtype,budget,mult", [
    (1, "mean_share", torch.float32, 64, 4), (3, "max_share", torch.float32, 48, 2),
    (4, "sum_mass", torch.bfloat16, 64, 4), (16, "mean_share", torch.bfloat16, 96, 8),
    (3, "mean_share", torch.float32, 512, 4),  # more pages to choose than candidates: -1 padding
])
@pytest.mark.parametrize("pick", ["radix", "sort"])
def test_rerank_kernels_choose_the_pytorch_reranks_pages(g, rule, dtype, budget, mult, pick):
    """The two re-rank launches (kvlocks.selection.triton_rerank), given the candidates the selection
    picks at k' = M + sink + recent, against the full-width PyTorch re-rank (paged_rerank, then
    paged_select), on the real pipeline's inputs: summaries built from the keys, Eq. 4 scores and
    per-head LSE (rows of 2 to 40 pages, partial last pages, a row shorter than the candidate count)."""
    from kvlocks.plan import paged_score, paged_select
    from kvlocks.selection.rerank_paged import paged_rerank
    from kvlocks.selection.triton_rerank import rerank_pages

    hkv, d = 2, 64
    cfg = LocksConfig(budget=budget, rerank=mult, combine=rule)
    lens = [40 * S, 23 * S + 5, 2 * S + 3, 9 * S]
    q, k, v, table, seq, store = _paged_case(lens, hkv, g, d, cfg, seed=g)
    q, k = q.to(dtype), k.to(dtype)
    scores, lse, ranking = paged_score(q, store, table, seq, combine=rule, backend="torch")
    width = table.shape[1]
    kc = min(width, cfg.rerank_candidates(width) + cfg.sink_pages + cfg.recent_pages)
    cand = paged_select(ranking, seq, page_size=S, k=kc, sink_pages=cfg.sink_pages, recent_pages=cfg.recent_pages,
                        backend="torch").contiguous()
    ranking = paged_rerank(q, k, table, seq, scores, cfg, scale=d ** -0.5)
    want = paged_select(ranking, seq, page_size=S, k=cfg.pages_per_step, sink_pages=cfg.sink_pages,
                        recent_pages=cfg.recent_pages, backend="torch")
    got = rerank_pages(q, k, table, seq, scores, lse, cand, cfg, scale=d ** -0.5, pick=pick)
    assert got.tolist() == want.tolist()
    assert (got[2] >= 0).sum(-1).tolist() == [3, 3]  # the 3-page row: every page, then -1
