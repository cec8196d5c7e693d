"""Math of AM compaction and the bias fold, checked against closed forms and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlocks.compaction import (
    CompactionConfig, attention_scores, augment_keys, augment_queries, compact_head,
    compact_layer, exact_attention, fit_bias, fold_direction, fold_error_bound, fold_keys,
    merge_duplicates, merge_to_budget, partition_targets, query_alignment, refit_values,
    select_attention, select_omp, subsample_queries, top_t,
)

METHODS = ("am", "fold", "drop", "drop_refit", "rank1", "merge_fold")


def _data(T=48, D=16, n=160, seed=0, key_scale=1.0, q_shift=0.3):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, D, generator=g) * key_scale
    v = torch.randn(T, D, generator=g)
    q = torch.randn(n, D, generator=g) + q_shift  # non-zero mean, as real queries have
    return k, v, q


def _np_attention(q, k, v, scale, bias=None):
    """Brute-force float64 reference, one query at a time."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    b = np.zeros(k.shape[0]) if bias is None else bias.double().numpy()
    outs, lses = [], []
    for row in q:
        lg = np.array([row @ kk * scale for kk in k]) + b
        m = lg.max()
        e = np.exp(lg - m)
        outs.append((e[:, None] * v).sum(0) / e.sum())
        lses.append(m + math.log(e.sum()))
    return np.array(outs), np.array(lses)


def _queries_on_plane(q, u):
    """Project queries onto {q : q . u = 1} (float64 then float32)."""
    q64, u64 = q.double(), u.double()
    return (q64 + ((1 - q64 @ u64) / (u64 @ u64))[:, None] * u64[None, :]).float()


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("field,value,needle", [
    ("ratio", 0.0, "ratio=0.0"), ("ratio", 1.5, "ratio=1.5"), ("method", "evict", "'evict'"),
    ("selection", "random", "'random'"), ("beta_max", -4.0, "beta_max=-4.0"),
    ("fold_lambda", -1.0, "fold_lambda"), ("max_queries", 0, "max_queries=0"),
    ("ridge", float("nan"), "ridge"), ("merge_threshold", 1.5, "merge_threshold=1.5"),
    ("round_dtype", "int8", "'int8'"), ("bias_solver", "lbfgs", "'lbfgs'"), ("seed", 1.5, "seed"),
])
def test_config_rejects_bad_values(field, value, needle):
    with pytest.raises(ValueError, match="CompactionConfig") as err:
        CompactionConfig(**{field: value})
    assert needle in str(err.value)


def test_config_budget_and_json_roundtrip():
    cfg = CompactionConfig(ratio=0.1, method="am")
    assert cfg.budget(4096) == 410 and cfg.budget(3) == 1 and cfg.budget(1) == 1
    assert CompactionConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        CompactionConfig.from_json('{"ratioo": 0.1}')
    with pytest.raises(TypeError):
        CompactionConfig(0.1)  # keyword-only


# ---------------------------------------------------------------- attention and values

def test_exact_attention_matches_brute_force_with_bias():
    k, v, q = _data(T=9, D=8, n=7)
    bias = torch.linspace(-2, 2, 9)
    out, lse = exact_attention(q, k, v, bias=bias)
    ref_out, ref_lse = _np_attention(q, k, v, 1 / math.sqrt(8), bias)
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, atol=1e-5)


def test_refit_values_is_least_squares_optimum():
    k, v, q = _data(T=30, D=8, n=50)
    kept, target = k[:10], torch.randn(50, 8, dtype=torch.float64)
    beta = torch.linspace(-1, 1, 10)
    vc = refit_values(kept, q, target, bias=beta, ridge=0.0).double()
    lg = q.double().numpy() @ kept.double().numpy().T / math.sqrt(8) + beta.double().numpy()
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ref = np.linalg.lstsq(p, target.numpy(), rcond=None)[0]
    np.testing.assert_allclose(vc.numpy(), ref, rtol=1e-4, atol=1e-4)
    grad = p.T @ (p @ vc.numpy() - target.numpy())
    assert np.abs(grad).max() < 1e-5
    # relative ridge: closed form (P^T P + lam I)^-1 P^T O
    vr = refit_values(kept, q, target, bias=beta, ridge=1e-3).double().numpy()
    lam = 1e-3 * (p * p).sum() / 10
    np.testing.assert_allclose(vr, np.linalg.solve(p.T @ p + lam * np.eye(10), p.T @ target.numpy()),
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- selection

def test_top_t_ties_go_to_lower_index_and_sorted():
    assert top_t(torch.tensor([1.0, 2.0, 2.0, 2.0, 0.0]), 2).tolist() == [1, 2]
    assert top_t(torch.tensor([5.0, 1.0, 9.0, 9.0]), 3).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="t=5"):
        top_t(torch.zeros(4), 5)


def test_attention_scores_brute_force_and_selection():
    k, _, q = _data(T=20, D=8, n=30)
    w = torch.softmax(q.double() @ k.double().T / math.sqrt(8), dim=1)
    ref = (w ** 2).mean(0).sqrt()
    np.testing.assert_allclose(attention_scores(k, q).numpy(), ref.numpy(), rtol=1e-5)
    idx = select_attention(k, q, 6)
    assert idx.tolist() == sorted(torch.argsort(ref, descending=True)[:6].tolist())


def _grouped_keys(mults=(1, 2, 3, 4), D=8, seed=3):
    """Distinct keys, key g repeated mults[g] times (interleaved order)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(len(mults), D, generator=g) * 1.5
    order = [gi for r in range(max(mults)) for gi, m in enumerate(mults) if r < m]
    return base[order], order


def test_omp_recovers_one_key_per_duplicate_group():
    k, order = _grouped_keys()
    q = torch.randn(64, 8, generator=torch.Generator().manual_seed(4)) + 0.2
    idx = select_omp(k, q, 4)
    firsts = sorted({gi: i for i, gi in reversed(list(enumerate(order)))}.values())
    assert idx.tolist() == firsts  # first copy of each group; ties go to the lower position
    beta = fit_bias(k, idx, q)
    np.testing.assert_allclose(beta.exp().numpy(), [1, 2, 3, 4], rtol=1e-4)
    assert select_omp(k, q, 4).tolist() == idx.tolist()  # deterministic


# ---------------------------------------------------------------- bias fit

def test_bias_fit_duplicates_give_log2_exactly():
    base, _, q = _data(T=6, D=8, n=40)
    k = torch.cat([base, base])  # every key twice
    beta = fit_bias(k, torch.arange(6), q)
    np.testing.assert_allclose(beta.numpy(), math.log(2), atol=1e-5)
    z, _ = partition_targets(k, q)
    z_c, _ = partition_targets(base, q)
    np.testing.assert_allclose(z.numpy(), 2 * z_c.numpy(), rtol=1e-12)


@pytest.mark.parametrize("solver", ["active_set"])
def test_bias_fit_respects_box(solver):
    base, _, q = _data(T=4, D=8, n=30)
    k = torch.cat([base[:1].repeat(50, 1), base[1:]])  # key 0 x50: needs w=50 > e^3
    beta = fit_bias(k, torch.tensor([0, 50, 51, 52]), q, solver=solver)
    assert beta[0].item() == pytest.approx(3.0, abs=1e-4)
    assert beta.min() >= -3.0 and beta.max() <= 3.0
    k2, _, q2 = _data(T=40, D=8, n=60, seed=5)
    narrow = fit_bias(k2, torch.arange(0, 40, 5), q2, beta_min=-0.5, beta_max=0.25, solver=solver)
    assert narrow.min() >= -0.5 and narrow.max() <= 0.25


def test_huge_logits_stay_finite():
    k, v, q = _data(T=32, D=8, n=40)
    k = k * 1000.0
    z, shift = partition_targets(k, q)
    assert torch.isfinite(z).all() and torch.isfinite(shift).all() and (z >= 1).all()
    beta = fit_bias(k, torch.arange(0, 32, 4), q)
    assert torch.isfinite(beta).all()
    for method in ("am", "fold"):
        head = compact_head(k, v, q, 8, CompactionConfig(method=method))
        assert all(torch.isfinite(x).all() for x in (head.keys, head.values))


def test_keep_all_gives_zero_bias_and_original_values():
    k, v, q = _data(T=12, D=16, n=200, key_scale=0.7)
    head = compact_head(k, v, q, 12, CompactionConfig(method="am", ridge=0.0))
    assert head.indices.tolist() == list(range(12))
    np.testing.assert_allclose(head.beta.numpy(), 0.0, atol=1e-4)
    np.testing.assert_allclose(head.values.numpy(), v.numpy(), atol=1e-3)
    qt = torch.randn(50, 16)
    out, _ = exact_attention(qt, head.keys, head.values, bias=head.beta)
    np.testing.assert_allclose(out.numpy(), exact_attention(qt, k, v)[0].numpy(), atol=1e-4)


# ---------------------------------------------------------------- fold

def test_fold_direction_matches_independent_numpy_solve():
    _, _, q = _data(T=4, D=16, n=100)
    u = fold_direction(q, fold_lambda=1e-2)
    x = q.double().numpy()
    sigma = np.cov(x.T, bias=True)
    mu = x.mean(0)
    a = sigma + 1e-2 * np.trace(sigma) / 16 * np.eye(16)
    y = np.linalg.solve(a, mu)
    np.testing.assert_allclose(u.numpy(), y / (mu @ y), rtol=1e-5, atol=1e-6)
    assert query_alignment(q, u).double().mean().item() == pytest.approx(1.0, abs=1e-5)


def test_fold_direction_identical_queries_and_zero_mean():
    q0 = torch.randn(16)
    u = fold_direction(q0.repeat(20, 1))
    assert (q0 @ u).item() == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(u.numpy(), (q0 / (q0 @ q0)).numpy(), rtol=1e-4)
    with pytest.raises(ValueError, match="zero mean"):
        fold_direction(torch.cat([torch.ones(3, 4), -torch.ones(3, 4)]))


@pytest.mark.parametrize("scale", [None, 0.05])
def test_fold_is_exact_where_q_dot_u_is_one(scale):
    k, v, q = _data(T=24, D=16, n=80)
    beta = torch.empty(24).uniform_(-3, 3, generator=torch.Generator().manual_seed(1))
    u = fold_direction(q)
    kf = fold_keys(k, beta, u, scale=scale, round_dtype="float32")
    probe = _queries_on_plane(torch.randn(40, 16) * 2, u)
    biased, _ = exact_attention(probe, k, v, scale=scale, bias=beta)
    folded, _ = exact_attention(probe, kf, v, scale=scale)
    np.testing.assert_allclose(folded.numpy(), biased.numpy(), atol=2e-5)


def test_fold_keys_round_to_storage_dtype():
    k, _, q = _data(T=10, D=16, n=30)
    kf = fold_keys(k, torch.ones(10), fold_direction(q), round_dtype="bfloat16")
    assert kf.dtype == torch.float32
    assert torch.equal(kf, kf.to(torch.bfloat16).to(torch.float32))


def test_fold_error_bound_holds_on_random_queries():
    k, v, q = _data(T=96, D=16, n=256, key_scale=1.5)
    am = compact_head(k, v, q, 16, CompactionConfig(method="am"))
    u = fold_direction(q)
    kf = fold_keys(am.keys, am.beta, u, round_dtype="float32")
    g = torch.Generator().manual_seed(7)
    probes = torch.cat([q, torch.randn(2000, 16, generator=g) * 1.5 + 0.3,
                        torch.randn(500, 16, generator=g) * 4.0])  # near and far queries
    ref, _ = exact_attention(probes, am.keys, am.values, bias=am.beta)
    got, _ = exact_attention(probes, kf, am.values)
    err = (got - ref).norm(dim=1)
    bound = fold_error_bound(probes, u, am.values)
    assert (err <= bound + 1e-5).all()
    assert (err > 1e-3).any()  # the check is not vacuous
    # dropping beta is the special case q . u = 0 of the same bound
    drop, _ = exact_attention(probes, am.keys, am.values)
    assert ((drop - ref).norm(dim=1) <= fold_error_bound(probes, torch.zeros(16), am.values) + 1e-5).all()


# ---------------------------------------------------------------- baselines

def test_rank1_augmented_attention_is_exact():
    k, v, q = _data(T=20, D=16, n=30)
    beta = torch.linspace(-3, 3, 20)
    for scale in (None, 0.1):
        s = 1 / math.sqrt(16) if scale is None else scale
        aug, _ = exact_attention(augment_queries(q, scale=scale), augment_keys(k, beta), v, scale=s)
        ref, _ = exact_attention(q, k, v, scale=scale, bias=beta)
        np.testing.assert_allclose(aug.numpy(), ref.numpy(), atol=1e-6)
    cfg = CompactionConfig(method="am")
    am, r1 = compact_head(k, v, q, 6, cfg), compact_head(k, v, q, 6, cfg.replace(method="rank1"))
    assert r1.head_dim_out == 17 and r1.keys.shape == (6, 17) and r1.beta is None
    out_r1, _ = exact_attention(augment_queries(q), r1.keys, r1.values, scale=0.25)
    np.testing.assert_allclose(out_r1.numpy(), exact_attention(q, am.keys, am.values, bias=am.beta)[0].numpy(),
                               atol=1e-6)


def test_drop_is_am_with_beta_zeroed_and_drop_refit_refits():
    k, v, q = _data()
    cfg = CompactionConfig(method="am")
    am, drop = compact_head(k, v, q, 8, cfg), compact_head(k, v, q, 8, cfg.replace(method="drop"))
    assert drop.beta is None and torch.equal(drop.indices, am.indices)
    assert torch.equal(drop.keys, am.keys) and torch.equal(drop.values, am.values)
    refit = compact_head(k, v, q, 8, cfg.replace(method="drop_refit"))
    target, _ = exact_attention(q, k, v)
    np.testing.assert_allclose(refit.values.numpy(), refit_values(
        am.keys, q, target, ridge=cfg.ridge, anchor=v[am.indices], anchor_weight=cfg.value_anchor).numpy(),
        atol=1e-6)
    err = lambda h, b: (exact_attention(q, h.keys, h.values, bias=b)[0] - target).norm()  # noqa: E731
    plain = compact_head(k, v, q, 8, cfg.replace(method="drop_refit", value_anchor=0.0))
    assert err(plain, None) <= err(drop, None) + 1e-6  # without the anchor: the LS optimum without bias


def test_merge_duplicates_log_count_is_exact():
    k, order = _grouped_keys()
    v = torch.stack([torch.full((8,), float(gi)) for gi in order])  # same value per group
    m = merge_duplicates(k, v, threshold=0.999)
    assert m.counts.tolist() == [1, 2, 3, 4] and m.indices.tolist() == [0, 1, 2, 3]
    q = torch.randn(30, 8)
    np.testing.assert_allclose(exact_attention(q, m.keys, m.values, bias=m.bias)[0].numpy(),
                               exact_attention(q, k, v)[0].numpy(), atol=1e-5)


def test_merge_to_budget_hits_t_exactly():
    k, order = _grouped_keys()
    v = torch.randn(10, 8)
    q = torch.randn(30, 8)
    for t in (2, 4, 7, 10):
        m = merge_to_budget(k, v, q, t, threshold=0.999)
        assert m.keys.shape == (t, 8) and m.indices.tolist() == sorted(m.indices.tolist())
    assert merge_to_budget(k, v, q, 10, threshold=0.999).counts.tolist() == [1] * 10
    assert merge_to_budget(k, v, q, 4, threshold=0.999).counts.sum().item() == 10


def test_merge_fold_bound_and_plane_exactness():
    k, order = _grouped_keys(mults=(1, 2, 3, 4, 2, 5), D=16)
    v = torch.randn(k.shape[0], 16)
    q = torch.randn(60, 16) + 0.3
    head = compact_head(k, v, q, 6, CompactionConfig(method="merge_fold", round_dtype="float32"))
    assert head.beta is None and head.keys.shape == (6, 16)
    np.testing.assert_allclose(head.fitted_bias.exp().numpy(), [1, 2, 3, 4, 2, 5], rtol=1e-6)
    merged = merge_duplicates(k, v, threshold=0.98)
    probe = _queries_on_plane(torch.randn(20, 16), head.u)
    kf = fold_keys(merged.keys, merged.bias, head.u, round_dtype="float32")
    np.testing.assert_allclose(exact_attention(probe, kf, merged.values)[0].numpy(),
                               exact_attention(probe, k, v)[0].numpy(), atol=2e-5)
    # bound with the log-count range [0, log 5], same values, arbitrary queries
    far = torch.randn(500, 16) * 2
    ref, _ = exact_attention(far, merged.keys, merged.values, bias=merged.bias)
    err = (exact_attention(far, kf, merged.values)[0] - ref).norm(dim=1)
    bound = fold_error_bound(far, head.u, merged.values, beta_min=0.0, beta_max=math.log(5))
    assert (err <= bound + 1e-5).all() and (err > 1e-3).any()


# ---------------------------------------------------------------- api

@pytest.mark.parametrize("method", METHODS)
def test_compact_head_shapes_and_dtypes(method):
    k, v, q = _data()
    head = compact_head(k.bfloat16(), v.bfloat16(), q.bfloat16(), 10, CompactionConfig(method=method))
    assert head.keys.shape == (10, head.head_dim_out) and head.values.shape == (10, 16)
    assert head.keys.dtype == head.values.dtype == torch.float32 and head.indices.dtype == torch.int64
    assert head.indices.tolist() == sorted(set(head.indices.tolist()))
    assert (head.beta is not None) == (method == "am")
    assert (head.u is not None) == (method in ("fold", "merge_fold"))


def test_fold_close_to_am_on_context_queries():
    k, v, q = _data(T=96, D=16, n=256)
    cfg = CompactionConfig(method="am", ratio=0.2)
    am, fold = compact_head(k, v, q, None, cfg), compact_head(k, v, q, None, cfg.replace(method="fold"))
    drop = compact_head(k, v, q, None, cfg.replace(method="drop"))
    target, _ = exact_attention(q, k, v)
    err = lambda h: (exact_attention(q, h.keys, h.values, bias=h.beta)[0] - target).norm().item()  # noqa: E731
    assert am.keys.shape[0] == 19 and err(fold) < err(drop)


def test_compact_layer_equals_per_head_and_subsampling():
    g = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(3, 40, 8, generator=g) for _ in range(3))
    q = q + 0.3
    cfg = CompactionConfig(method="fold", max_queries=25, seed=1)
    layer = compact_layer(k, v, q, 5, cfg)
    assert layer.keys.shape == (3, 5, 8) and layer.u.shape == (3, 8) and layer.beta is None
    for h in range(3):
        head = compact_head(k[h], v[h], q[h], 5, cfg)  # the per-head path (float64 partitions)
        assert torch.equal(layer.indices[h], head.indices) and torch.equal(layer.keys[h], head.keys)
        torch.testing.assert_close(layer.values[h], head.values, rtol=1e-4, atol=1e-5)
    sub = subsample_queries(q[0], 25, 1)
    assert sub.shape == (25, 8) and torch.equal(sub, subsample_queries(q[0], 25, 1))


def test_bad_inputs_raise_clear_errors():
    k, v, q = _data(T=10, D=8, n=12)
    cfg = CompactionConfig(method="am")
    bad_k = k.clone()
    bad_k[3, 2] = float("nan")
    with pytest.raises(ValueError, match="K contains 1 NaN/Inf"):
        compact_head(bad_k, v, q, 4, cfg)
    bad_q = q.clone()
    bad_q[0, 0] = float("inf")
    with pytest.raises(ValueError, match="Q contains"):
        compact_head(k, v, bad_q, 4, cfg)
    with pytest.raises(ValueError, match=r"V shape \(9, 8\) does not match K shape \(10, 8\)"):
        compact_head(k, v[:9], q, 4, cfg)
    with pytest.raises(ValueError, match=r"Q must have 8 columns, got shape \(12, 7\)"):
        compact_head(k, v, q[:, :7], 4, cfg)
    for t in (0, 11):
        with pytest.raises(ValueError, match=f"t={t}: must satisfy 1 <= t <= T=10"):
            compact_head(k, v, q, t, cfg)
    with pytest.raises(ValueError, match="K is empty"):
        compact_head(k[:0], v[:0], q, 1, cfg)
    with pytest.raises(ValueError, match="must be a CompactionConfig"):
        compact_head(k, v, q, 4, {"method": "am"})
    with pytest.raises(ValueError, match="KV head count mismatch"):
        compact_layer(k[None].repeat(2, 1, 1), v[None], q[None], 4, cfg)
    nan_v = v[None].repeat(2, 1, 1)
    nan_v[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="KV head 1: V contains"):
        compact_layer(k[None].repeat(2, 1, 1), nan_v, q[None].repeat(2, 1, 1), 4, cfg)
