"""Baseline selectors against brute-force references, matched bytes, and the HF decode path."""

import math

import pytest
import torch

from kvlocks import LocksConfig, build_summaries, dense_decode
from kvlocks.config import method_config
from kvlocks.scoring import exact_page_lse
from kvlocks.attention.per_head import sparse_decode_per_head
from kvlocks.selection import LayerView, choose_pages, get_selector, selector_names
from kvlocks_lab.selectors import (
    CentroidSelector, LokiCalibration, LokiSelector, QuestSelector, RandomSelector, ShadowKVSelector,
    locks_page_bytes, matched_selector, matched_settings,
)
from kvlocks_lab.selectors.centroid import centroid_bytes
from kvlocks_lab.selectors.loki import loki_bytes
from kvlocks.attention.per_head import distinct_pages
from kvlocks_lab.selectors.quest import envelope_bound, envelope_bytes, page_envelopes
from kvlocks_lab.selectors.shadowkv import shadowkv_bytes

D = 32


def _view(keys, mask=None, layer=None):
    return LayerView(keys=keys, summaries=None, token_mask=mask, scale=D**-0.5, layer=layer)


def _padded(lead, n, pad):
    keys = torch.randn(*lead, n, D)
    mask = torch.ones(*lead, n, dtype=torch.bool)
    mask[..., :pad] = False
    keys[..., :pad, :] *= 40  # padding keys with huge logits must not matter
    return keys, mask


def _brute_topk(scores, total, k):
    """Forced sink page 0 and last page, then the best by score (ties: lower index)."""
    order = sorted(range(1, total - 1), key=lambda j: (-float(scores[j]), j))
    return sorted([0, total - 1] + order[: max(0, min(k, total) - 2)])


def test_oracle_per_head_is_each_heads_exact_top_k():
    c = LocksConfig(budget=80)
    keys = torch.randn(2, 2, 11 * 16 + 7, D)
    q = torch.randn(2, 2, 3, D) * 3
    got = choose_pages(q, _view(keys), c, get_selector("oracle_per_head"))
    assert got.shape == (2, 2, 3, 5)
    lse = exact_page_lse(q, keys, 16)  # [2, 2, 3, 11]
    for b in range(2):
        for h in range(2):
            for g in range(3):
                assert got[b, h, g].tolist() == _brute_topk(lse[b, h, g], 12, 5)
    # heads of a group really differ here, so a shared selection could not serve them all
    assert any(not torch.equal(got[b, h, 0], got[b, h, g]) for b in range(2) for h in range(2) for g in (1, 2))
    assert 5 <= distinct_pages(got, 12) <= 12


def test_per_head_decode_matches_brute_force_and_dense():
    keys, values = torch.randn(2, 70, D), torch.randn(2, 70, D)
    q = torch.randn(2, 4, D)
    pages = torch.stack([torch.tensor([[0, 2, 4], [0, 1, 4], [0, 3, 4], [1, 2, 4]])] * 2)  # [2, 4, 3]
    out, _ = sparse_decode_per_head(q, keys, values, pages, 16)
    for h in range(2):
        for g in range(4):
            tok = torch.cat([torch.arange(p * 16, min(p * 16 + 16, 70)) for p in pages[h, g].tolist()])
            ref, _ = dense_decode(q[h, g:g + 1], keys[h, tok], values[h, tok])
            assert torch.allclose(out[h, g], ref[0], atol=1e-5)
    every = torch.arange(5).expand(2, 4, 5)
    per_head, _ = sparse_decode_per_head(q, keys, values, every, 16)
    assert torch.allclose(per_head, dense_decode(q, keys, values)[0], atol=1e-5)
    mask = torch.arange(70).expand(2, 70) >= torch.tensor([[0], [23]])  # row 1 left-padded
    per_head, _ = sparse_decode_per_head(q, keys, values, every, 16, token_mask=mask)
    assert torch.allclose(per_head, dense_decode(q, keys, values, token_mask=mask)[0], atol=1e-5)


@pytest.mark.parametrize("bits", [None, 32, 16, 8])
@pytest.mark.parametrize("sub_pages", [1, 3])
def test_quest_bounds_every_logit_and_the_page_lse(bits, sub_pages):
    keys, mask = _padded((2,), 9 * 16 + 3, 20)
    keys = keys.to(torch.bfloat16) if bits is None else keys
    q = torch.randn(2, 4, D) * 4
    pm = mask[:, :144].unflatten(-1, (9, 16))
    kmin, kmax, count = page_envelopes(keys[:, :144].float().unflatten(1, (9, 16)), pm, sub_pages, bits)
    ub = envelope_bound(q, kmin, kmax, D**-0.5)  # [2, 4, 9, M]
    logits = torch.einsum("hgd,hnd->hgn", q, keys[:, :144].float()) * D**-0.5
    edges = [-(-b * 16 // sub_pages) for b in range(sub_pages + 1)]
    for t in range(144):
        if not mask[0, t] or not mask[1, t]:
            continue
        blk = max(b for b in range(sub_pages) if edges[b] <= t % 16)
        assert bool((ub[..., t // 16, blk] >= logits[..., t] - 1e-5).all())
    scores = QuestSelector(bits=bits, sub_pages=sub_pages).page_scores(q, _view(keys, mask), LocksConfig())
    exact = exact_page_lse(q, keys, 16, scale=D**-0.5, token_mask=pm)
    assert torch.isneginf(scores[..., 0]).all()  # page 0 is padding only
    assert bool((scores[..., 1:] >= exact[..., 1:] - 1e-5).all())
    if bits in (None, 32) and sub_pages == 1:  # Quest's own score: the bound on the max logit
        assert torch.allclose(scores[..., 2:], ub[..., 2:, 0] + math.log(16), atol=1e-5)


def test_centroid_is_jensen_lower_bound_and_exact_on_constant_pages():
    keys = torch.randn(2, 8 * 16, D)
    keys[:, 16:32] = keys[:, 16:17]  # a page whose keys are all equal
    q = torch.randn(2, 3, D)
    got = CentroidSelector(bits=32).page_scores(q, _view(keys), LocksConfig())
    exact = exact_page_lse(q, keys, 16, scale=D**-0.5)
    mu = keys.unflatten(1, (8, 16)).mean(2)
    assert torch.allclose(got, math.log(16) + torch.einsum("hgd,hpd->hgp", q, mu) * D**-0.5, atol=1e-5)
    assert bool((got <= exact + 1e-5).all())
    assert torch.allclose(got[..., 1], exact[..., 1], atol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_shadowkv_and_loki_at_full_rank_are_exact(padded):
    keys, mask = _padded((3,), 10 * 16 + 5, 21) if padded else (torch.randn(3, 165, D), None)
    q = torch.randn(3, 4, D) * 3
    pm = None if mask is None else mask[:, :160].unflatten(-1, (10, 16))
    exact = exact_page_lse(q, keys, 16, scale=D**-0.5, token_mask=pm)
    calib = LokiCalibration.fit([torch.randn(2, 3, 300, D)])  # different "text" than evaluated
    for sel in (ShadowKVSelector(rank=D, bits=32), LokiSelector(calib, rank=D, bits=32)):
        got = sel.page_scores(q, _view(keys, mask), LocksConfig())
        fin = torch.isfinite(exact)
        assert torch.equal(fin, torch.isfinite(got)), sel
        assert torch.allclose(got[fin], exact[fin], atol=1e-4), sel
    # reduced rank is an approximation that still scores every real page finitely
    low = ShadowKVSelector(rank=4).page_scores(q, _view(keys, mask), LocksConfig())
    assert torch.equal(torch.isfinite(low), torch.isfinite(exact))


def test_shadowkv_basis_is_per_sequence_and_exact_when_keys_share_a_subspace():
    basis = torch.linalg.qr(torch.randn(D, 3)).Q.T  # 3 directions shared by the whole sequence
    keys = torch.randn(2, 8 * 16, 3) @ basis + torch.randn(2, 1, D)
    q = torch.randn(2, 2, D)
    exact = exact_page_lse(q, keys, 16, scale=D**-0.5)
    got = ShadowKVSelector(rank=3, bits=32).page_scores(q, _view(keys), LocksConfig())
    assert torch.allclose(got, exact, atol=1e-4)


def test_loki_needs_a_calibration_and_the_layer():
    keys, q = torch.randn(2, 64, D), torch.randn(2, 2, D)
    with pytest.raises(ValueError, match="calibrat"):
        get_selector("loki").page_scores(q, _view(keys), LocksConfig())
    calib = LokiCalibration.fit([torch.randn(2, 50, D), torch.randn(2, 50, D)])
    with pytest.raises(ValueError, match="layer"):
        LokiSelector(calib).page_scores(q, _view(keys), LocksConfig())
    a = LokiSelector(calib, rank=4).page_scores(q, _view(keys, layer=0), LocksConfig())
    b = LokiSelector(calib, rank=4).page_scores(q, _view(keys, layer=1), LocksConfig())
    assert a.shape == (2, 2, 4) and not torch.equal(a, b)  # each layer uses its own basis
    with pytest.raises(ValueError, match="Hkv"):
        LokiSelector(calib).page_scores(torch.randn(3, 2, D), _view(torch.randn(3, 64, D), layer=0), LocksConfig())


@pytest.mark.parametrize("partial", [0, 7])
def test_streaming_selects_sink_and_last_pages(partial):
    c = LocksConfig(budget=80, sink_pages=2)
    keys = torch.randn(2, 12 * 16 + partial, D)
    got = choose_pages(torch.randn(2, 4, D), _view(keys), c, get_selector("streaming"))
    total = 12 + (partial > 0)
    assert got.tolist() == [[0, 1] + list(range(total - 3, total))] * 2


def test_random_is_deterministic_given_seed_layer_and_step():
    c = LocksConfig(budget=64)
    keys, q = torch.randn(2, 21 * 16, D), torch.randn(2, 3, D)
    pick = lambda sel, n=320, layer=0: choose_pages(q, _view(keys[:, :n], layer=layer), c, sel)  # noqa: E731
    a = pick(RandomSelector(seed=1))
    assert torch.equal(a, pick(RandomSelector(seed=1)))
    assert a[:, 0].tolist() == [0, 0] and a[:, -1].tolist() == [19, 19]
    others = [pick(RandomSelector(seed=2)), pick(RandomSelector(seed=1), layer=3), pick(RandomSelector(seed=1), n=336)]
    assert all(not torch.equal(a[:, 1:-1], o[:, 1:-1]) for o in others)
    assert not torch.equal(a[0], a[1])  # rows draw independently


@pytest.mark.parametrize("name", selector_names())
def test_every_selector_keeps_sink_recent_and_skips_padding(name):
    c = LocksConfig(budget=64, rank=4)
    keys, mask = _padded((2, 2), 9 * 16 + 4, 35)
    q = torch.randn(2, 2, 3, D)
    view = LayerView(keys=keys, summaries=build_summaries(keys[..., :144, :].unflatten(2, (9, 16)), c),
                     token_mask=mask, scale=D**-0.5, layer=0)
    sel = LokiSelector(LokiCalibration.fit([torch.randn(2, 100, D)])) if name == "loki" else get_selector(name)
    got = choose_pages(q, view, c, sel)
    assert got.shape == ((2, 2, 3, 4) if name == "oracle_per_head" else (2, 2, 4))
    assert bool((got[..., 0] == 2).all()) and bool((got[..., -1] == 9).all())  # sink page 2, partial page 9
    assert bool((got >= 2).all())  # pages 0 and 1 hold padding only


CONFIGS = [
    LocksConfig(), LocksConfig(rank=4), LocksConfig(rank=16, basis_bits=8),
    LocksConfig(basis_bits=16, coef_bits=16), LocksConfig(page_size=32, budget=256, rank=8),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"S{c.page_size}R{c.rank}b{c.basis_bits}c{c.coef_bits}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matched_bytes_match_locks_within_one_step(config, head_dim):
    summ = build_summaries(torch.randn(1, config.page_size, head_dim), config)
    target = locks_page_bytes(config, head_dim)
    assert target == sum(summ.bytes_per_page())
    size = {  # bytes per page of each selector as a function of its knob, and the knob's maximum
        "quest": (lambda x, b: sum(envelope_bytes(head_dim, x, b)), config.page_size, "sub_pages"),
        "centroid": (lambda x, b: sum(centroid_bytes(head_dim, x, b)), config.page_size, "sub_pages"),
        "loki": (lambda x, b: sum(loki_bytes(config.page_size, x, b)), head_dim, "rank"),
        "shadowkv": (lambda x, b: sum(shadowkv_bytes(head_dim, config.page_size, x, b)), head_dim, "rank"),
    }
    for name, (fn, high, knob) in size.items():
        for bits in (8, 16):
            s = matched_settings(name, config, head_dim, bits=bits)
            x = s[knob]
            assert fn(x, bits) <= target or x == 1, (name, s)
            assert x == high or fn(x + 1, bits) > target, (name, s)
            sel = matched_selector(name, config, head_dim, bits=bits)
            assert sum(sel.bytes_per_page(config, head_dim, 2)) == fn(x, bits)
    # the registry's shadowkv/loki default to the matched rank
    for name in ("shadowkv", "loki"):
        assert get_selector(name).resolved_rank(config, head_dim) == matched_settings(name, config, head_dim)["rank"]


def test_matched_numbers_at_the_paper_setting():
    c = LocksConfig()  # S=16, R=8, int4 basis, int8 coefficients: 818 bytes at D=128
    assert locks_page_bytes(c, 128) == 818
    assert matched_settings("loki", c, 128) == {"bits": 16, "rank": 25}  # 800 bytes
    assert matched_settings("shadowkv", c, 128) == {"bits": 8, "rank": 41}  # 656 + 128 + 34 = 818
    assert matched_settings("quest", c, 128) == {"bits": 16, "sub_pages": 1}  # 512; 2 would be 1024
    assert matched_settings("centroid", c, 128) == {"bits": 16, "sub_pages": 3}  # 768


# ---------------------------------------------------------------- the HF path, bundled model

PROMPT = (
    "Alice keeps her bicycle in the red shed behind the library. Bob keeps his canoe in the "
    "boathouse by the river. Carol keeps her telescope on the roof of the observatory. "
    "Where does Alice keep her bicycle?"
)
CALIBRATION = (
    "The committee met on Tuesday to review the budget for the new bridge. Engineers presented "
    "three designs, each with a different cost and timeline, and the mayor asked for a vote."
)


@pytest.fixture(scope="module")
def hf():
    from kvlocks.integrations.hf import LocksCache, cache_kwargs
    from kvlocks.models import load
    from kvlocks_lab.selectors import calibrate

    model, tok = load("smollm2-135m")

    def ids(text):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok(chat, return_tensors="pt", add_special_tokens=False).input_ids

    def generate(method, budget, new=16, prompt=PROMPT):
        config = LocksConfig(budget=budget)  # a method name of a LOCKS mode (locks_centroid) builds its config
        cache = LocksCache(model.config, method=method,
                           config=method_config(method, config) if isinstance(method, str) else config)
        out = model.generate(input_ids=ids(prompt), max_new_tokens=new, do_sample=False, **cache_kwargs(model, cache))
        return out, cache

    calib = calibrate(model, ids(CALIBRATION))
    return model, generate, calib, generate("full", 1024)[0], ids(PROMPT).shape[1]


def _method(name, calib):
    return LokiSelector(calib) if name == "loki" else name


@pytest.mark.model
@pytest.mark.parametrize("name", selector_names())
def test_every_selector_equals_full_at_budget_above_context(hf, name):
    model, generate, calib, full, prompt_len = hf
    out, cache = generate(_method(name, calib), 1024)
    assert torch.equal(out, full)
    assert cache.stats.steps == full.shape[1] - prompt_len - 1  # every generated token but the first


@pytest.mark.model
@pytest.mark.parametrize("name", selector_names())
def test_every_selector_runs_at_a_small_budget_with_its_bytes(hf, name):
    model, generate, calib, _, prompt_len = hf
    out, cache = generate(_method(name, calib), 32, new=2)  # exactly one decode step
    n = prompt_len + 1  # context at that step
    hkv, d = model.config.num_key_value_heads, model.config.head_dim
    sel, s = cache.selector, cache.stats.summary()
    assert cache.stats.steps == 1 and out.shape[1] == n + 1
    if name == "locks":
        expect = hkv * (n // 16) * sum(cache.layers[0].store.summaries.bytes_per_page())
    elif cache.config.rerank_scores == "centroid":  # locks_centroid: int8 centroids and a float16 scale
        expect = hkv * (n // 16) * (d + 2)
    elif sel.reads_all_keys:
        expect = hkv * n * d * 4
    else:
        expect = hkv * sel.selection_bytes(cache.config, d, 4, n // 16)
    if cache.config.rerank:  # locks_centroid chooses candidates: their keys and the sink's and recent's
        pc = n // 16
        expect += hkv * min(pc, cache.config.rerank_candidates(pc) + 2) * 16 * d * 4
    assert s["selection_bytes"] == pytest.approx(expect)
    if name == "quest":
        assert expect == hkv * (n // 16) * 2 * d * 4  # the fp32 envelope, not the keys
    if name == "oracle_per_head":
        g = model.config.num_attention_heads // hkv
        assert 2 <= s["pages_selected"] <= 2 * g
    else:
        assert s["pages_selected"] == 2
    assert s["bytes_read"] < s["full_bytes"] or name == "oracle_per_head"


@pytest.mark.model
def test_loki_without_calibration_fails_with_how_to(hf):
    generate = hf[1]
    with pytest.raises(ValueError, match="calibrate"):
        generate("loki", 32, new=2)
