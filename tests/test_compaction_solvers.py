"""Bounded least squares and NNLS (kvlocks.compaction.solvers) against scipy and closed forms.

scipy (the lab extra) is the independent reference: ``lsq_linear(method="bvls")`` (exact
active set) and ``nnls``; it is imported inside the tests, never by the product.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlocks.compaction import CompactionConfig, fit_bias, mass_design, partition_targets
from kvlocks.compaction import refit_values, select_omp, top_t
from kvlocks.compaction.solvers import bounded_lstsq, box_qp, nnls

F64 = torch.float64
LO, HI = math.exp(-3.0), math.exp(3.0)  # the bias fit's box


def _obj(a, x, b):
    a, x, b = (np.asarray(v, dtype=np.float64) for v in (a, x, b))
    return float(np.sum((a @ x - b) ** 2))


def _scipy_box(a, b, lo, hi):
    from scipy.optimize import lsq_linear

    return lsq_linear(np.asarray(a), np.asarray(b), bounds=(lo, hi), method="bvls", tol=1e-14).x


def _assert_same_objective(a, b, x, ref, rtol=1e-9):
    """Objective of x no worse than the reference's: relative rtol (absolute near a zero optimum).

    Where scipy's bvls stops short of the optimum (it can, on designs with many weights at a
    bound), x may be better; :func:`_assert_kkt` then certifies x's optimality on its own.
    """
    fx, fr = _obj(a, x, b), _obj(a, ref, b)
    assert fx <= fr + rtol * fr + 1e-20 * len(b), (fx, fr)


def _assert_kkt(a, b, x, lo, hi):
    """KKT conditions of min ||Ax - b||^2 on a box: zero gradient where free, outward at a bound."""
    a, b, x = (v.to(F64).numpy() for v in (a, b, x))
    g = a.T @ (a @ x - b)
    lo, hi = np.broadcast_to(np.asarray(lo, dtype=np.float64), x.shape), \
        np.broadcast_to(np.asarray(hi, dtype=np.float64), x.shape)
    tol = 1e-9 * float((np.abs(a).T @ (np.abs(a) @ np.abs(x) + np.abs(b))).max())
    assert ((x >= lo) & (x <= hi)).all()
    at_lo, at_hi = x <= lo, x >= hi
    free = ~at_lo & ~at_hi
    assert np.abs(g[free]).max(initial=0.0) <= tol
    assert (-g[at_lo]).max(initial=-1.0) <= tol  # at lo: g >= 0
    assert g[at_hi].max(initial=-1.0) <= tol  # at hi: g <= 0


def _real_like_design(T=600, D=32, n=400, t=100, seed=0, sinks=2):
    """Row-scaled mass design of a head with real-like structure.

    Keys: a shared offset (the non-zero mean post-RoPE keys have), clustered directions and a
    few sink keys most queries attend to; queries with a non-zero mean. Kept keys: the top t
    by RMS attention (kvlocks' own selection), so the design looks like the bias fit's.
    """
    from kvlocks.compaction import select_attention

    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(12, D, generator=g) * 2.0
    k = centres[torch.randint(0, 12, (T,), generator=g)] + 0.7 * torch.randn(T, D, generator=g)
    k = k + 1.5 * torch.randn(1, D, generator=g)
    qm = torch.randn(D, generator=g)
    q = qm + 0.8 * torch.randn(n, D, generator=g)
    k[:sinks] = 3.0 * qm / qm.norm() * math.sqrt(D) + 0.3 * torch.randn(sinks, D, generator=g)
    scale = 1.0 / math.sqrt(D)
    idx = select_attention(k, q, t, scale=scale)
    z, shift = partition_targets(k, q, scale=scale)
    return mass_design(k[idx], q, shift, scale=scale) / z[:, None], (k, idx, q)  # [n, t]


# ---------------------------------------------------------------- hand-computed cases

def test_one_variable_closed_forms():
    a, b = torch.tensor([[2.0]], dtype=F64), torch.tensor([4.0], dtype=F64)
    assert bounded_lstsq(a, b, -math.inf, math.inf).item() == pytest.approx(2.0, abs=1e-14)
    assert bounded_lstsq(a, b, 0.0, 1.0).item() == 1.0  # clipped at hi
    assert bounded_lstsq(a, b, 3.0, 5.0).item() == 3.0  # clipped at lo
    assert bounded_lstsq(a, b, 1.5, 1.5).item() == 1.5  # lo == hi
    assert nnls(a, -b).item() == 0.0


def test_diagonal_design_clips_each_coordinate():
    a = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    b = torch.tensor([1.0, -4.0, 9.0], dtype=F64)  # unconstrained optimum (1, -2, 3)
    x = bounded_lstsq(a, b, 0.0, 2.0)
    assert x.tolist() == pytest.approx([1.0, 0.0, 2.0], abs=1e-14)
    lo, hi = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([0.5, 5.0, 5.0])
    assert bounded_lstsq(a, b, lo, hi).tolist() == pytest.approx([0.5, -1.0, 3.0], abs=1e-14)


def test_nnls_coupled_two_variable_case():
    # unconstrained optimum (1, -1); with x >= 0: x2 = 0, x1 = argmin (x1-1)^2 + x1^2 = 1/2
    a = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], dtype=F64)
    b = torch.tensor([1.0, 0.0, -1.0], dtype=F64)
    assert nnls(a, b).tolist() == pytest.approx([0.5, 0.0], abs=1e-14)
    assert bounded_lstsq(a, b, -math.inf, math.inf).tolist() == pytest.approx([1.0, -1.0], abs=1e-13)


def test_duplicate_columns_reach_the_exact_fit():
    col = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=F64)
    a = torch.stack([col, col, 0.5 * col], dim=1)  # rank 1
    x = bounded_lstsq(a, 2.0 * col, 0.0, 1.0)  # any x in the box with x1 + x2 + x3 / 2 = 2
    assert float(x[0] + x[1] + 0.5 * x[2]) == pytest.approx(2.0, abs=1e-12)
    assert _obj(a, x, 2.0 * col) < 1e-24 and bool(((x >= 0) & (x <= 1)).all())


def test_zero_column_stays_at_its_start():
    a = torch.tensor([[1.0, 0.0], [2.0, 0.0]], dtype=F64)
    b = torch.tensor([1.0, 2.0], dtype=F64)
    assert nnls(a, b).tolist() == [pytest.approx(1.0, abs=1e-14), 0.0]
    x0 = torch.tensor([0.0, 0.25], dtype=F64)
    assert bounded_lstsq(a, b, 0.0, 1.0, x0=x0).tolist() == [pytest.approx(1.0, abs=1e-14), 0.25]


# ---------------------------------------------------------------- against scipy

@pytest.mark.parametrize("n,t,seed", [(40, 10, 0), (200, 50, 1), (30, 60, 2), (5, 1, 3), (300, 120, 4)])
def test_random_box_matches_scipy_with_both_bounds_active(n, t, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, t, generator=g, dtype=F64)
    b = 3.0 * torch.randn(n, generator=g, dtype=F64)
    lo, hi = -0.2, 0.3
    x = bounded_lstsq(a, b, lo, hi)
    ref = _scipy_box(a.numpy(), b.numpy(), lo, hi)
    assert ((x == lo).sum() > 0 and (x == hi).sum() > 0) or t == 1
    _assert_same_objective(a, b, x, ref)
    _assert_kkt(a, b, x, lo, hi)
    if n >= t:  # full column rank: the minimiser is unique
        np.testing.assert_allclose(x.numpy(), ref, atol=1e-7)


@pytest.mark.parametrize("n,t,seed", [(400, 100, 0), (300, 200, 1), (50, 100, 2), (400, 1, 3),
                                      (1000, 150, 4)])
def test_real_like_mass_design_matches_scipy(n, t, seed):
    a, _ = _real_like_design(n=n, t=t, seed=seed)
    b = torch.ones(n, dtype=F64)
    x = bounded_lstsq(a, b, LO, HI, x0=torch.ones(t, dtype=F64))
    ref = _scipy_box(a.numpy(), b.numpy(), LO, HI)
    _assert_same_objective(a, b, x, ref)
    _assert_kkt(a, b, x, LO, HI)
    if n >= t and int(torch.linalg.matrix_rank(a)) == t:
        cond = float(torch.linalg.cond(a))
        np.testing.assert_allclose(np.log(x.numpy()), np.log(ref), atol=max(1e-6, 1e-15 * cond ** 2))


def test_rank_deficient_columns_match_scipy_objective():
    a, _ = _real_like_design(n=300, t=80, seed=5)
    a = torch.cat([a, a[:, :20], 0.5 * (a[:, 20:30] + a[:, 30:40])], dim=1)  # t = 110, rank 80
    b = torch.ones(300, dtype=F64)
    x = bounded_lstsq(a, b, LO, HI)
    _assert_same_objective(a, b, x, _scipy_box(a.numpy(), b.numpy(), LO, HI))
    _assert_kkt(a, b, x, LO, HI)


@pytest.mark.parametrize("n,t,seed", [(60, 20, 0), (30, 50, 1), (200, 80, 2)])
def test_nnls_matches_scipy(n, t, seed):
    from scipy.optimize import nnls as scipy_nnls

    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, t, generator=g, dtype=F64) - 0.3
    b = torch.randn(n, generator=g, dtype=F64)
    x = nnls(a, b)
    ref, _ = scipy_nnls(a.numpy(), b.numpy())
    assert (x == 0).sum() > 0 and bool((x >= 0).all())
    _assert_same_objective(a, b, x, ref)
    _assert_kkt(a, b, x, 0.0, math.inf)
    if n >= t:
        np.testing.assert_allclose(x.numpy(), ref, atol=1e-8)


def test_fit_bias_matches_scipy_bias_fit():
    a_unused, (k, idx, q) = _real_like_design(n=500, t=60, seed=7)
    beta = fit_bias(k, idx, q, scale=1.0 / math.sqrt(k.shape[1]))
    a = a_unused.numpy()
    ref = _scipy_box(a, np.ones(a.shape[0]), LO, HI)
    w = np.exp(beta.double().numpy())  # float32 beta: compare at float32 precision
    assert abs(_obj(a, w, np.ones(a.shape[0])) - _obj(a, ref, np.ones(a.shape[0]))) \
        <= 1e-5 * _obj(a, ref, np.ones(a.shape[0]))
    np.testing.assert_allclose(beta.numpy(), np.log(ref), atol=1e-4)
    assert beta.min() >= -3.0 and beta.max() <= 3.0


# ---------------------------------------------------------------- batching and determinism

def test_batch_equals_one_at_a_time_and_is_deterministic():
    designs = [_real_like_design(n=300, t=40, seed=s)[0] for s in range(3)]
    a = torch.stack(designs)  # [3, 300, 40]
    b = torch.ones(3, 300, dtype=F64)
    lo = torch.tensor([LO, 0.5, LO], dtype=F64)[:, None]  # per-problem bounds, [3, 1]
    x = bounded_lstsq(a, b, lo, HI)
    assert x.shape == (3, 40)
    for i in range(3):
        alone = bounded_lstsq(a[i], b[i], float(lo[i]), HI)
        np.testing.assert_allclose(x[i].numpy(), alone.numpy(), rtol=1e-8)
    assert torch.equal(x, bounded_lstsq(a, b, lo, HI))


def test_warm_start_reaches_the_same_optimum():
    a, _ = _real_like_design(n=300, t=60, seed=8)
    b = torch.ones(300, dtype=F64)
    cold = bounded_lstsq(a, b, LO, HI)
    h, c = a.T @ a, a.T @ b
    warm, iters = box_qp(h[None], c[None], LO, HI, x0=cold[None])
    np.testing.assert_allclose(warm[0].numpy(), cold.numpy(), rtol=1e-9)
    assert int(iters[0]) <= 2  # already optimal: one face solve and the KKT check


# ---------------------------------------------------------------- callers

def _scipy_omp(keys, q, t):
    """select_omp's algorithm with scipy's NNLS (the reference implementation)."""
    from scipy.optimize import nnls as scipy_nnls

    z, shift = partition_targets(keys, q)
    a = (mass_design(keys, q, shift) / z[:, None]).numpy()
    norms = np.linalg.norm(a, axis=0)
    resid, free, chosen = np.ones(a.shape[0]), np.ones(a.shape[1], dtype=bool), []
    for _ in range(t):
        corr = np.where(norms > 0, (a.T @ resid) / np.where(norms > 0, norms, 1.0), -np.inf)
        cand = np.flatnonzero(free)
        c = corr[cand]
        near = np.flatnonzero(c >= c.max() - 1e-9 * abs(c.max()))
        chosen.append(int(cand[near[0]]))
        free[chosen[-1]] = False
        w, _ = scipy_nnls(a[:, chosen], np.ones(a.shape[0]))
        resid = 1.0 - a[:, chosen] @ w
    return sorted(chosen)


@pytest.mark.parametrize("seed", [0, 1])
def test_select_omp_matches_scipy_reference(seed):
    _, (k, _, q) = _real_like_design(T=200, D=16, n=150, t=10, seed=seed)
    assert select_omp(k, q, 25).tolist() == _scipy_omp(k, q, 25)


def test_top_t_matches_lexsort_with_ties():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=g).float()  # many ties
    ref = np.sort(np.lexsort((np.arange(200), -scores.double().numpy()))[:37])
    assert top_t(scores, 37).tolist() == ref.tolist()
    assert top_t(torch.tensor([0.0, -0.0, 1.0]), 2).tolist() == [0, 2]  # -0.0 ties with 0.0


def test_refit_values_cholesky_matches_augmented_lstsq():
    _, (k, idx, q) = _real_like_design(n=400, t=50, seed=3)
    target = torch.randn(400, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    vc = refit_values(k[idx], q, target, ridge=1e-6).double()
    from kvlocks.compaction import attention_weights

    p = attention_weights(q, k[idx], dtype=F64)
    lam = 1e-6 * float((p * p).sum()) / 50
    aug = torch.cat([p, lam ** 0.5 * torch.eye(50, dtype=F64)])
    ref = torch.linalg.lstsq(aug, torch.cat([target, torch.zeros(50, 8, dtype=F64)]),
                             driver="gelsd").solution
    np.testing.assert_allclose(vc.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_config_names_the_solver_and_reads_scipy_names():
    assert CompactionConfig().bias_solver == "active_set"
    with pytest.raises(ValueError, match=r"bias_solver='trf': allowed \('active_set',\)"):
        CompactionConfig(bias_solver="trf")
    text = CompactionConfig().to_json().replace('"active_set"', '"bvls"')
    assert CompactionConfig.from_json(text) == CompactionConfig()
    with pytest.raises(ValueError, match="solver='lbfgs'"):
        fit_bias(torch.randn(4, 2), torch.tensor([0]), torch.randn(3, 2), solver="lbfgs")


# ---------------------------------------------------------------- bad input

def test_bad_inputs_raise_clear_errors():
    a, b = torch.randn(5, 3, dtype=F64), torch.randn(5, dtype=F64)
    with pytest.raises(ValueError, match=r"b shape \(4,\) must be A's shape"):
        bounded_lstsq(a, b[:4], 0.0, 1.0)
    bad = a.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="A contains 1 NaN/Inf"):
        bounded_lstsq(bad, b, 0.0, 1.0)
    with pytest.raises(ValueError, match="b contains"):
        nnls(a, torch.full((5,), float("inf"), dtype=F64))
    with pytest.raises(ValueError, match="lo <= hi.*entry 1 has lo=2.0 > hi=1.0"):
        bounded_lstsq(a, b, torch.tensor([0.0, 2.0, 0.0]), 1.0)
    with pytest.raises(ValueError, match="lo contains NaN"):
        bounded_lstsq(a, b, float("nan"), 1.0)
    with pytest.raises(ValueError, match="lo must be < \\+inf"):
        bounded_lstsq(a, b, math.inf, math.inf)
    with pytest.raises(ValueError, match=r"lo of shape \(2,\) does not broadcast to the solution.s shape \(3,\)"):
        bounded_lstsq(a, b, torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match=r"x0 shape \(2,\) must be \(3,\)"):
        bounded_lstsq(a, b, 0.0, 1.0, x0=torch.zeros(2))
    with pytest.raises(ValueError, match="A must be a torch.Tensor"):
        nnls(a.numpy(), b)
    with pytest.raises(ValueError, match="A has no columns"):
        nnls(a[:, :0], b)
    with pytest.raises(ValueError, match=r"H shape \(1, 3, 2\) must be \[B, t, t\]"):
        box_qp(torch.zeros(1, 3, 2, dtype=F64), torch.zeros(1, 3, dtype=F64), 0.0, 1.0)
    with pytest.raises(ValueError, match="not positive semidefinite"):
        box_qp(-torch.eye(2, dtype=F64)[None], torch.ones(1, 2, dtype=F64), -1.0, 1.0)
    indefinite = torch.tensor([[[1.0, 2.0], [2.0, 1.0]]], dtype=F64)
    with pytest.raises(ValueError, match="not positive semidefinite"):
        box_qp(indefinite, torch.ones(1, 2, dtype=F64), -1.0, 1.0)
