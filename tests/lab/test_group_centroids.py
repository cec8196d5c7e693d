"""The member-centroid group score (kvlocks_lab.fidelity.group_centroids): the exact group mass
when every key of a page is its centroid (int8-exact keys), never above the exact group mass
otherwise (Jensen, up to the centroids' int8 rounding), a single spiked page kept visible, and the
fidelity variant name that selects it."""

from __future__ import annotations

import math

import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.fidelity.group_centroids import centroid_group_scores
from kvlocks_lab.fidelity.variants import variant


def _exact(q, keys, size, scale):
    """Exact log-sum-exp of each group of ``size`` consecutive keys: [..., G, NG]."""
    return torch.logsumexp((q.double() @ keys.double().transpose(-1, -2)).unflatten(-1, (-1, size)) * scale, -1)


def test_pages_of_identical_keys_give_the_exact_group_mass():
    gen = torch.Generator().manual_seed(0)
    d, pages, s = 16, 12, 16
    # one integer vector per page, max |x| = 127: its int8 centroid (scale absmax / 127) is exact
    mu = torch.randint(-127, 128, (2, pages, d), generator=gen).float()
    mu[..., 0] = 127.0
    keys = mu.repeat_interleave(s, dim=1)  # [2, P*S, D]
    q = 0.01 * torch.randn(2, 3, d, generator=gen)
    cfg = LocksConfig(budget=64, rank=4)
    got = centroid_group_scores(q, keys, cfg, group_pages=4, scale=0.125)
    assert got.shape == (2, 3, 3)
    torch.testing.assert_close(got.double(), _exact(q, keys, 4 * s, 0.125), rtol=0, atol=1e-4)


def test_the_score_is_not_above_the_exact_group_mass():
    gen = torch.Generator().manual_seed(1)
    d, s, m = 32, 16, 4
    keys = 2 * torch.randn(3, 16 * s * m // 4, d, generator=gen)
    q = 1.5 * torch.randn(3, 5, d, generator=gen)
    scale = d ** -0.5
    cfg = LocksConfig(budget=64, rank=4)
    got = centroid_group_scores(q, keys, cfg, group_pages=m, scale=scale).double()
    exact = _exact(q, keys, m * s, scale)
    # int8 rounding moves each centroid coordinate by at most absmax/254: bound its effect on q.mu
    slack = scale * q.abs().sum(-1, keepdim=True).double() * keys.abs().amax().double() / 254
    assert (got <= exact + slack + 1e-6).all()
    assert (got < exact).float().mean() > 0.9  # strictly below: the keys spread around their centroids


def test_a_needle_page_dominates_its_group_score():
    gen = torch.Generator().manual_seed(2)
    d, s, m = 32, 16, 8
    keys = 0.3 * torch.randn(1, 4 * m * s, d, generator=gen)  # 4 groups of 8 pages
    q = torch.randn(1, 1, d, generator=gen)
    needle = 2 * m + 5  # a page of group 2
    keys[0, needle * s:(needle + 1) * s] += 6.0 * q[0, 0] / q[0, 0].norm()  # ~6 nats above the rest
    scale = d ** -0.5
    got = centroid_group_scores(q, keys, LocksConfig(budget=64, rank=4), group_pages=m, scale=scale)
    assert int(got.argmax()) == 2
    page = math.log(s) + scale * (keys[0, needle * s:(needle + 1) * s].mean(0) @ q[0, 0])
    assert abs(float(got[0, 0, 2]) - float(page)) < 0.05  # the needle page's own term, not an average


def test_the_variant_name():
    v = variant("locks_hierc2_k4")
    assert (v.group_pages, v.group_keep, v.group_centroids, v.group_bound) == (2, 4, True, False)
    assert not variant("locks_hier16_k2").group_centroids and variant("locks_hierb16").group_bound
