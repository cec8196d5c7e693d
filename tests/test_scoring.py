import math

import pytest
import torch

from kvlocks import LocksConfig, build_summaries, score_pages
from kvlocks.scoring import combine_group, exact_page_lse
from kvlocks.summary.build import spectral_basis

from conftest import low_rank_pages


def brute_force_page_lse(q, pages):
    """Exact per-page log-sum-exp with a Python loop: q [H, G, D], pages [H, P, S, D]."""
    h, g, d = q.shape
    out = torch.empty(h, g, pages.shape[1], dtype=torch.float64)
    for a in range(h):
        for b in range(g):
            for j in range(pages.shape[1]):
                z = [float(q[a, b].double() @ pages[a, j, i].double()) / math.sqrt(d) for i in range(pages.shape[2])]
                m = max(z)
                out[a, b, j] = m + math.log(sum(math.exp(v - m) for v in z))
    return out


def test_exact_page_lse_matches_brute_force():
    q = torch.randn(2, 3, 32)
    pages = torch.randn(2, 4, 16, 32)
    got = exact_page_lse(q, pages.flatten(1, 2), 16)
    assert torch.allclose(got.double(), brute_force_page_lse(q, pages), atol=1e-5)


def test_eq4_is_exact_when_page_rank_le_rank_unquantized():
    pages = low_rank_pages((3,), 6, 16, 64, rank=8, scale=0.5)
    q = torch.randn(3, 4, 64) * 2
    c = LocksConfig(rank=8, basis_bits=16, coef_bits=16)
    est = score_pages(q, build_summaries(pages, c), c)
    eta = (est.double() - brute_force_page_lse(q, pages)).abs().max()
    assert float(eta) < 5e-3  # float16 storage of basis/coefficients only


def test_eta_within_eq7_bound_at_lower_rank():
    """eta <= max ||q_perp|| sqrt(tau) / sqrt(d) (Eq. 7), summaries unquantized."""
    pages = torch.randn(2, 8, 16, 64)
    q = torch.randn(2, 3, 64) * 3
    for rank in (1, 4, 8, 12):
        c = LocksConfig(rank=rank, basis_bits=16, coef_bits=16)
        est = score_pages(q, build_summaries(pages, c), c)
        exact = brute_force_page_lse(q, pages)
        _, basis, _, tau, _ = spectral_basis(pages, rank)  # basis [H, P, R, D]
        proj = torch.einsum("hgd,hprd->hgpr", q, basis)
        q_perp = q[:, :, None, :] - torch.einsum("hgpr,hprd->hgpd", proj, basis)
        bound = q_perp.norm(dim=-1) * tau.sqrt()[:, None, :] / math.sqrt(64)  # [H, G, P]
        err = (est.double() - exact).abs()
        # small slack for float16 storage of the summary
        assert bool((err <= bound.double() * 1.001 + 5e-3).all()), (rank, float((err - bound).max()))


def test_quantization_error_grows_as_bits_shrink():
    """Against the unquantized estimate: int8 < int4 < int2 log-mass error (rank-8 pages)."""
    pages = low_rank_pages((2,), 32, 16, 64, rank=8)
    q = torch.randn(2, 3, 64)
    ref = score_pages(q, build_summaries(pages, LocksConfig(basis_bits=16, coef_bits=16)),
                      LocksConfig(basis_bits=16, coef_bits=16))
    errs = {}
    for bits in (8, 4, 2):
        c = LocksConfig(rank=8, basis_bits=bits)
        errs[bits] = float((score_pages(q, build_summaries(pages, c), c) - ref).abs().mean())
    assert errs[8] < errs[4] < errs[2]


def test_combine_rules_hand_computed():
    s = torch.log(torch.tensor([[[1.0, 3.0], [3.0, 1.0], [2.0, 2.0]]]))  # G=3 heads, P=2 pages
    mean = combine_group(s, "mean_share")
    assert torch.allclose(mean, torch.tensor([[0.5, 0.5]]))
    assert torch.allclose(combine_group(s, "max_share"), torch.tensor([[0.75, 0.75]]))
    assert torch.allclose(combine_group(s, "sum_mass").exp(), torch.tensor([[6.0, 6.0]]))
    s2 = torch.log(torch.tensor([[[1.0, 9.0], [10.0, 10.0]]]))
    # share-averaging: (0.1 + 0.5) / 2 = 0.3 vs (0.9 + 0.5) / 2 = 0.7; mass: 11 vs 19
    assert torch.allclose(combine_group(s2, "mean_share"), torch.tensor([[0.3, 0.7]]))
    assert torch.allclose(combine_group(s2, "sum_mass").exp(), torch.tensor([[11.0, 19.0]]))
    with pytest.raises(ValueError, match="combine rule"):
        combine_group(s2, "vote")


def test_score_pages_rejects_mismatched_shapes():
    c = LocksConfig()
    s = build_summaries(torch.randn(2, 3, 16, 64), c)
    with pytest.raises(ValueError, match="head_dim"):
        score_pages(torch.randn(2, 4, 32), s, c)
    with pytest.raises(ValueError, match="leading dims"):
        score_pages(torch.randn(3, 4, 64), s, c)
    q = torch.randn(2, 4, 64)
    q[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        score_pages(q, s, c)
