"""``locks_centroid``: the LOCKS summaries' int8 centroids choose candidates, their exact page
masses pick the pages. Checked against the closed form ``log n_p + scale * q.mu_p`` (and Jensen's
bound), the exact oracle (candidates covering every page), and the Hugging Face cache's decode
and byte accounting."""

from __future__ import annotations

import math

import pytest
import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks.selection.selectors import LayerView, LocksSelector, OracleSelector, choose_pages
from kvlocks.summary.build import build_summaries
from kvlocks_lab.selectors.locks_centroid import LocksCentroidSelector

CENTROID_METHOD = LocksCentroidSelector.name

S, D = 16, 32


def _view(keys, cfg, token_mask=None):
    hkv, n, d = keys.shape
    pc = n // S
    summ = build_summaries(keys[:, : pc * S].reshape(hkv, pc, S, d), cfg)
    return LayerView(keys=keys, summaries=summ, token_mask=token_mask, scale=d ** -0.5)


def test_scores_are_the_centroid_closed_form_and_below_the_page_mass():
    gen = torch.Generator().manual_seed(0)
    keys = 2 * torch.randn(2, 12 * S, D, generator=gen)
    q = torch.randn(2, 3, D, generator=gen)
    cfg = LocksConfig(budget=64, rank=4)
    view = _view(keys, cfg)
    got = LocksCentroidSelector().page_scores(q, view, cfg)  # [2, 3, 12]
    # the int8 centroid by hand: absmax / 127 per page, as the summary stores it
    mu = view.summaries.centroid.float() * view.summaries.centroid_scale.float().unsqueeze(-1)  # [2, 12, D]
    want = math.log(S) + (q.double() @ mu.double().transpose(-1, -2)) * D ** -0.5
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    exact = torch.logsumexp((q.double() @ keys.double().transpose(-1, -2)).unflatten(-1, (12, S)) * D ** -0.5, -1)
    slack = D ** -0.5 * q.abs().sum(-1, keepdim=True).double() * keys.abs().amax().double() / 254  # int8 rounding
    assert (got.double() <= exact + slack).all() and (got.double() < exact).float().mean() > 0.9


def test_padding_counts_only_real_tokens_and_an_empty_page_scores_minus_inf():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 4 * S, D, generator=gen)
    q = torch.randn(1, 2, D, generator=gen)
    mask = torch.ones(1, 4 * S, dtype=torch.bool)
    mask[:, : S + 5] = False  # page 0 empty, page 1 with 11 real tokens
    cfg = LocksConfig(budget=64, rank=4)
    view, full = _view(keys, cfg, mask), _view(keys, cfg)
    got = LocksCentroidSelector().page_scores(q, view, cfg)
    base = LocksCentroidSelector().page_scores(q, full, cfg)  # the same centroids, 16 tokens a page
    assert torch.isneginf(got[..., 0]).all()
    torch.testing.assert_close(got[..., 1], base[..., 1] - math.log(S) + math.log(11))
    torch.testing.assert_close(got[..., 2:], base[..., 2:])


@pytest.mark.parametrize("rule", ["mean_share", "max_share", "sum_mass"])
def test_candidates_covering_every_page_give_the_oracle_selection(rule):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 21 * S + 7, D, generator=gen)
    q = torch.randn(2, 3, D, generator=gen) * 2
    cfg = LocksConfig(budget=64, combine=rule, rank=4, rerank=64)
    view = _view(keys, cfg)
    assert torch.equal(choose_pages(q, view, cfg, LocksCentroidSelector()),
                       choose_pages(q, view, cfg, OracleSelector()))


def test_the_method_sets_its_candidate_multiple_decodes_as_the_oracle_and_counts_centroid_bytes():
    """A small random Llama (fp32, CPU): ``locks_centroid`` with candidates covering every page
    gives the oracle's logits at every step; its selection bytes are the centroids (int8 and a
    float16 scale) and the candidates' keys."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlocks.integrations.hf import LocksCache, enable, method_names
    from kvlocks.integrations.hf.decode import prefill, step

    mc = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=1024)
    assert CENTROID_METHOD in method_names()
    cache = LocksCache(mc, method=CENTROID_METHOD, config=method_config(CENTROID_METHOD, LocksConfig(budget=64)))
    assert type(cache.selector) is LocksSelector  # a mode of locks: the decode plan runs it
    assert (cache.config.rerank, cache.config.rerank_min, cache.config.rerank_scores) == (16, 256, "centroid")
    assert (cache.fork().config.rerank, cache.fork().config.rerank_min) == (16, 256)
    own = method_config(CENTROID_METHOD, LocksConfig(rerank=4, rerank_min=32))
    assert (own.rerank, own.rerank_min) == (4, 32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(mc).eval()
    enable(model)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    runs = {}
    for method, lcfg in ((CENTROID_METHOD, LocksConfig(budget=48, rank=4, rerank=64, rerank_scores="centroid")),
                         ("oracle", LocksConfig(budget=48, rank=4))):
        cache = LocksCache(model.config, method=method, config=lcfg)
        logits = [prefill(model, cache, ids)]
        for _ in range(4):
            logits.append(step(model, cache, int(torch.argmax(logits[-1]))))
        runs[method] = (torch.stack([x.float() for x in logits]), cache.stats.summary())
    torch.testing.assert_close(runs[CENTROID_METHOD][0], runs["oracle"][0], rtol=1e-5, atol=1e-5)
    # per (layer, step), contexts 150-154 (9 full pages of 16): 2 KV heads x (9 centroids of
    # 32 + 2 bytes + the 144 candidate keys of 32 float32 values)
    assert runs[CENTROID_METHOD][1]["selection_bytes"] == 2 * (9 * (D + 2) + 144 * D * 4)
