"""Centroid page scores (Eq. 4 at rank 0) against closed forms, and the configuration that asks for them."""

import math

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks.scoring.reference import exact_page_lse, score_pages_from_centroids
from kvlocks.summary.build import build_summaries


def test_pages_of_one_repeated_key_score_their_exact_log_sum_exp():
    """A page whose S keys are all equal has centroid = that key and log-sum-exp = log S + s q.k:
    the centroid score is exact there (float16 centroids: coef_bits=16), and a page of n real
    tokens scores log n + s q.k under a token mask."""
    torch.manual_seed(0)
    s, d, p = 16, 64, 5
    cfg = LocksConfig(page_size=s, coef_bits=16, basis_bits=16)
    rows = torch.randn(p, 1, d).half().float()  # values float16 holds exactly
    keys = rows.expand(p, s, d).reshape(p * s, d)  # [N, D]
    q = torch.randn(3, d)  # [G, D]
    summ = build_summaries(keys.view(p, s, d), cfg)
    got = score_pages_from_centroids(q, summ, scale=0.125)  # [G, P]
    want = exact_page_lse(q, keys, s, scale=0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    mask = torch.ones(p, s, dtype=torch.bool)
    mask[1, 5:] = False  # 5 real tokens
    mask[3] = False  # none: -inf
    got = score_pages_from_centroids(q, summ, scale=0.125, token_mask=mask)
    torch.testing.assert_close(got[:, 1], math.log(5) + 0.125 * q @ rows[1, 0], rtol=1e-5, atol=1e-4)
    assert torch.isneginf(got[:, 3]).all()


def test_centroid_scores_are_at_most_the_exact_mass_jensen():
    torch.manual_seed(1)
    s, d = 16, 32
    keys = torch.randn(8 * s, d)
    q = torch.randn(2, d) * 3
    summ = build_summaries(keys.view(8, s, d), LocksConfig(page_size=s, coef_bits=16, basis_bits=16))
    exact = exact_page_lse(q, keys, s, scale=d ** -0.5)
    # the centroid of the stored (float16) keys: Jensen up to that rounding
    assert (score_pages_from_centroids(q, summ, scale=d ** -0.5) <= exact + 1e-3).all()


def test_centroid_candidates_need_the_rerank():
    assert LocksConfig(rerank=8, rerank_scores="centroid").rerank_scores == "centroid"
    with pytest.raises(ValueError, match="needs rerank in 2..64"):
        LocksConfig(rerank=0, rerank_scores="centroid")
    with pytest.raises(ValueError, match="set rerank explicitly"):
        LocksConfig(rerank_scores="centroid")
    with pytest.raises(ValueError, match=r"allowed \('summary', 'centroid'\)"):
        LocksConfig(rerank=8, rerank_scores="centroids")
