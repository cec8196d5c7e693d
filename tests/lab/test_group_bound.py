"""The upper-bound group score (kvlocks_lab.fidelity.group_bound): never below the group's exact
log-sum-exp, for random, low-rank and spiked keys at several group ranks; exact for a group of
identical keys (up to the centroid's quantization)."""

from __future__ import annotations

import math

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.fidelity.group_bound import bound_groups, bound_scores
from kvlocks_lab.selectors.hier import Groups


def _exact(q, keys, size, scale):
    return torch.logsumexp((q.double() @ keys.double().transpose(-1, -2)).unflatten(-1, (-1, size)) * scale, -1).float()


@pytest.mark.parametrize("kind", ["random", "low_rank", "spiked"])
@pytest.mark.parametrize("rank", [1, 4, 16])
def test_the_bound_is_never_below_the_exact_group_mass(kind, rank):
    gen = torch.Generator().manual_seed(rank)
    d, n = 32, 16 * 4 * 6  # 6 groups of 4 pages
    if kind == "random":
        keys = 2 * torch.randn(2, n, d, generator=gen)
    else:
        keys = torch.randn(2, n, 3, generator=gen) @ torch.randn(3, d, generator=gen) + 0.05 * torch.randn(2, n, d, generator=gen)
    if kind == "spiked":
        keys[:, 77] += 6 * torch.randn(2, d, generator=gen)
    q = 1.5 * torch.randn(2, 5, d, generator=gen)
    cfg = Groups(pages=4, rank=rank).config(LocksConfig(budget=64, rank=4))
    scale = d ** -0.5
    bound = bound_scores(q, bound_groups(keys, cfg), scale=scale)
    assert bound.shape == (2, 5, 6)
    assert (bound >= _exact(q, keys, 64, scale) - 1e-5).all()


def test_identical_keys_give_the_exact_mass():
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(16, generator=gen)
    keys = key.expand(1, 2 * 32, 16).clone()  # 2 groups of 32 identical keys
    q = torch.randn(1, 3, 16, generator=gen)
    cfg = Groups(pages=2, rank=2).config(LocksConfig(budget=32, rank=2))
    bound = bound_scores(q, bound_groups(keys, cfg), scale=0.25)
    exact = math.log(32) + 0.25 * (q @ key)  # [1, 3]
    torch.testing.assert_close(bound, exact.unsqueeze(-1).expand(1, 3, 2), atol=0.05, rtol=0)
