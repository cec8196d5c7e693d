"""Metrics against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from kvlocks_lab.eval.metrics import (
    exact_agreement,
    kl_divergence,
    paired_bootstrap_ci,
    perplexity,
    prefix_agreement,
    token_agreement,
    token_logprobs,
    top1_agreement,
)


def test_kl_of_known_distributions():
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.25, 0.75]).log()
    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3)
    assert kl_divergence(p, q).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    assert kl_divergence(q, p).item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)
    assert kl_divergence(p, p).item() == 0.0


def test_kl_zero_probabilities_logits_and_batches():
    p = torch.tensor([1.0, 0.0]).log()  # log 0 = -inf contributes nothing
    q = torch.tensor([0.5, 0.5]).log()
    assert kl_divergence(p, q).item() == pytest.approx(math.log(2), abs=1e-6)
    assert math.isinf(kl_divergence(q, p).item())  # method gives 0 where full does not
    logits = torch.randn(2, 3, 11)
    shifted = logits + 7.0  # logits are re-normalised: a constant shift changes nothing
    kl = kl_divergence(logits, shifted)
    assert kl.shape == (2, 3) and kl.dtype == torch.float32 and kl.abs().max() < 1e-5
    other = torch.randn(2, 3, 11)
    ref = (logits.softmax(-1) * (logits.log_softmax(-1) - other.log_softmax(-1))).sum(-1)
    torch.testing.assert_close(kl_divergence(logits.bfloat16().float(), other), ref, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="shapes differ"):
        kl_divergence(logits, other[:, :2])


def test_top1_agreement():
    full = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]]).log()
    meth = torch.tensor([[0.2, 0.5, 0.3], [0.1, 0.6, 0.3]]).log()
    assert top1_agreement(full, meth).tolist() == [1.0, 0.0]


def test_token_logprobs_and_perplexity():
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.25, 0.65]])
    lp = token_logprobs(probs.log(), torch.tensor([0, 1]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.5), math.log(0.25)]))
    assert perplexity(lp).item() == pytest.approx(math.sqrt(8.0), rel=1e-6)  # exp(ln 8 / 2)
    uniform = torch.full((3, 5), math.log(1 / 4))
    torch.testing.assert_close(perplexity(uniform), torch.full((3,), 4.0))
    padded = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])
    mask = torch.tensor([[1, 1, 0]])
    assert perplexity(padded, mask).item() == pytest.approx(2.0, rel=1e-6)


def test_greedy_agreements():
    full = [5, 6, 7, 8]
    assert exact_agreement(full, [5, 6, 7, 8]) == 1.0
    assert exact_agreement(full, [5, 6, 7]) == 0.0
    assert exact_agreement(torch.tensor(full), np.array(full)) == 1.0
    long_a, long_b = list(range(20)), list(range(16)) + [0, 0, 0, 0]
    assert prefix_agreement(long_a, long_b, 16) == 1.0 and exact_agreement(long_a, long_b) == 0.0
    assert prefix_agreement(long_a, long_b[:10], 16) == 0.0  # stopped early
    assert token_agreement(full, [5, 0, 7], n=16) == 0.5  # 2 of max(4, 3) positions
    assert token_agreement(long_a, long_b, n=None) == 0.8
    assert token_agreement([], []) == 1.0
    with pytest.raises(ValueError):
        prefix_agreement(full, full, 0)


def test_bootstrap_degenerate_for_identical_inputs():
    x = np.random.default_rng(1).random(50)
    ci = paired_bootstrap_ci(x, x.copy(), n_boot=500)
    assert (ci.mean, ci.low, ci.high, ci.n) == (0.0, 0.0, 0.0, 50)
    shifted = paired_bootstrap_ci(x + 0.25, x, n_boot=500)  # constant difference: no spread
    assert shifted.low == pytest.approx(0.25) and shifted.high == pytest.approx(0.25)


def test_bootstrap_two_records_hand_computed():
    # differences [0, 1]: resampled means are 0, 0.5, 1 with probabilities 1/4, 1/2, 1/4, so
    # the 2.5th and 97.5th percentiles of many resamples are 0 and 1
    ci = paired_bootstrap_ci([0.0, 1.0], [0.0, 0.0], n_boot=4000, seed=3)
    assert (ci.mean, ci.low, ci.high) == (0.5, 0.0, 1.0)


def test_bootstrap_contains_true_difference():
    rng = np.random.default_rng(0)
    b = rng.random(400)  # per-record difficulty, shared by both methods
    a = b + 0.2 + rng.normal(0, 0.1, 400)
    ci = paired_bootstrap_ci(a, b, n_boot=2000, seed=7)
    assert ci.contains(0.2) and not ci.contains(0.0) and ci.high - ci.low < 0.04
    assert ci.low < ci.mean < ci.high and ci.confidence == 0.95
    assert paired_bootstrap_ci(a, b, n_boot=2000, seed=7) == ci  # seeded
    wide = paired_bootstrap_ci(a, b, n_boot=2000, seed=7, confidence=0.99)
    assert wide.low <= ci.low and wide.high >= ci.high


def test_bootstrap_validates():
    with pytest.raises(ValueError):
        paired_bootstrap_ci([1, 2], [1])
    with pytest.raises(ValueError):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError, match="n_boot=0"):
        paired_bootstrap_ci([1], [1], n_boot=0)
    with pytest.raises(ValueError, match="confidence=1.5"):
        paired_bootstrap_ci([1], [1], confidence=1.5)
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap_ci([1, float("nan")], [1, 2])
