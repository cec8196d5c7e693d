"""The fidelity lab: metrics against hand-computed and brute-force cases, Theorem 1 on random data,
capture files (round trip, corrupt files), and a tiny end-to-end ``kvlocks fidelity`` run."""

import json
import pickle

import numpy as np
import pytest
import torch
from scipy import stats

from kvlocks import LocksConfig, build_summaries
from kvlocks.attention.reference import dense_decode, sparse_decode
from kvlocks_lab.fidelity import adaptive, bounds, ladder, metrics
from kvlocks_lab.fidelity.capture import ActivationCapture, load_capture, save_capture
from kvlocks_lab.fidelity.config import FidelityConfig
from kvlocks_lab.fidelity.exact import LayerData, exact_layer
from kvlocks_lab.fidelity.scopes import GlobalBases, centred, loki_logits, page_local_logits, sequence_logits
from kvlocks_lab.fidelity.tails import TailStats, page_properties
from kvlocks_lab.fidelity.variants import Resources, bytes_per_page, estimate, variant
from kvlocks.scoring import summary_logits
from kvlocks.selection import LayerView
from kvlocks_lab.selectors import LokiCalibration, LokiSelector, ShadowKVSelector
from kvlocks.summary import spectral_basis

S, D = 16, 32


def _data(h=2, p=9, q=3, g=3, scale=None, seed=0, spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, p * S, D, generator=gen) * spread
    values = torch.randn(h, p * S, D, generator=gen)
    queries = torch.randn(h, q, g, D, generator=gen) * spread
    return LayerData(keys=keys, values=values, queries=queries, scale=scale or D**-0.5, page_size=S, layer=0,
                     carrier_pages=(3, 4))


# ----------------------------------------------------------------------------- metrics


def test_coverage_and_carrier_retention_of_a_known_selection():
    share = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    mask = torch.tensor([[True, False, True, False], [False, True, True, True]])
    assert torch.allclose(metrics.coverage(share, mask), torch.tensor([0.4, 0.75]))
    carriers = torch.tensor([False, True, True, False])
    assert torch.allclose(metrics.carrier_retention(mask, carriers), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="carrier"):
        metrics.carrier_retention(mask, torch.zeros(4, dtype=torch.bool))


def test_mean_abs_error_and_distribution_by_hand():
    assert metrics.mean_abs_error(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.5, 2.0, 1.0])) == pytest.approx(7 / 6)
    d = metrics.distribution([0.5, None, float("nan"), 1.0, 0.0])
    assert d["mean"] == pytest.approx(0.5) and d["min"] == 0.0 and d["n"] == 3
    assert d["p5"] == pytest.approx(np.percentile([0.5, 1.0, 0.0], 5))
    assert metrics.distribution([])["mean"] is None


def _brute_shared(scores_g, k):
    """Forced page 0 and last page, then the best mean share (ties: lower index)."""
    share = torch.softmax(scores_g, dim=-1).mean(0)
    p = share.shape[0]
    rest = sorted(range(1, p - 1), key=lambda j: (-float(share[j]), j))
    return sorted([0, p - 1] + rest[: max(0, min(k, p) - 2)])


def test_selection_mask_matches_brute_force_shared_and_per_head():
    scores = torch.randn(2, 3, 4, 10) * 3  # [H, Q, G, P]
    for k in (2, 3, 5, 12):
        mask = metrics.selection_mask(scores, k)
        per = metrics.selection_mask(scores, k, per_head=True)
        for h in range(2):
            for t in range(3):
                want = _brute_shared(scores[h, t], k)
                for g in range(4):
                    assert torch.nonzero(mask[h, t, g]).flatten().tolist() == want
                    one = _brute_shared(scores[h, t, g : g + 1], k)
                    assert torch.nonzero(per[h, t, g]).flatten().tolist() == one


def test_oracle_maximises_group_mean_coverage_and_per_head_bounds_it():
    data = _data(seed=1)
    ex = exact_layer(data)
    for k in (3, 5):
        cov = {}
        for name, per_head, rule in (("oracle", False, "mean_share"), ("max", False, "max_share"),
                                     ("sum", False, "sum_mass"), ("per_head", True, "mean_share")):
            m = metrics.selection_mask(ex.lse, k, combine=rule, per_head=per_head)
            cov[name] = metrics.coverage(ex.share, m)  # [H, Q, G]
        g_mean = {n: c.mean(-1) for n, c in cov.items()}
        assert (g_mean["oracle"] >= g_mean["max"] - 1e-6).all() and (g_mean["oracle"] >= g_mean["sum"] - 1e-6).all()
        assert (cov["per_head"] >= cov["oracle"] - 1e-6).all()


def test_rank_correlations_match_scipy():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(6, 40, generator=gen)
    b = a + torch.randn(6, 40, generator=gen)
    b[1, :10] = b[1, 10]  # ties
    a[2] = torch.round(a[2])  # more ties
    rho, tau = metrics.spearman_rows(a, b), metrics.kendall_rows(a, b)
    for i in range(6):
        assert rho[i] == pytest.approx(stats.spearmanr(a[i].numpy(), b[i].numpy()).statistic, abs=1e-10)
        assert tau[i] == pytest.approx(stats.kendalltau(a[i].numpy(), b[i].numpy()).statistic, abs=1e-10)
    const = torch.ones(1, 40)
    assert np.isnan(metrics.spearman_rows(const, b[:1])[0]) and np.isnan(metrics.kendall_rows(const, b[:1])[0])


def test_exact_layer_and_output_error_match_the_attention_reference():
    data = _data(h=2, p=6, q=2, g=3)
    ex = exact_layer(data)
    out, lse = dense_decode(data.queries.flatten(1, 2), data.keys, data.values, scale=data.scale)
    assert torch.allclose(ex.out.flatten(1, 2), out, atol=1e-5)
    assert torch.allclose(ex.share.sum(-1), torch.ones(()), atol=1e-5)
    assert torch.allclose(torch.logsumexp(ex.lse, -1).flatten(1, 2), lse, atol=1e-5)
    mask = metrics.selection_mask(ex.lse, 3)  # [H, Q, G, P], shared over G
    abs_err, rel = metrics.output_errors(ex.share, ex.page_out, ex.out, mask)
    for h in range(2):
        for t in range(2):
            ids = torch.nonzero(mask[h, t, 0]).flatten()
            o_s, _ = sparse_decode(data.queries[h, t], data.keys[h], data.values[h], ids, S, scale=data.scale)
            err = (o_s - ex.out[h, t]).norm(dim=-1)
            assert torch.allclose(abs_err[h, t], err, atol=1e-5)
            assert torch.allclose(rel[h, t], err / ex.out[h, t].norm(dim=-1), atol=1e-5)


# ----------------------------------------------------------------------------- scopes and variants


def test_reconstructed_logits_agree_with_the_library_selectors():
    data = _data(p=7)
    cfg = LocksConfig(page_size=S, rank=8, budget=32)
    view = LayerView(keys=data.keys, summaries=None, token_mask=None, scale=data.scale, layer=0)
    q = data.flat_queries
    sk = ShadowKVSelector(rank=5, bits=8)
    got = torch.logsumexp(sequence_logits(q, data.pages, 5, 8, data.scale), -1)
    assert torch.allclose(got, sk.page_scores(q, view, cfg), atol=1e-4)
    calib = LokiCalibration.fit([torch.randn(2, 300, D)])
    lk = LokiSelector(calib, rank=6, bits=16)
    got = torch.logsumexp(loki_logits(q, data.pages, calib.basis(0, 6), 16, data.scale), -1)
    assert torch.allclose(got, lk.page_scores(q, view, cfg), atol=1e-4)
    # unquantized page-local logits = float16 summaries up to storage rounding
    mu, basis, coef, _, _ = spectral_basis(data.pages, 8)
    fp32 = page_local_logits(q, mu, basis, coef, data.scale)
    fp16 = summary_logits(q, build_summaries(data.pages, cfg.replace(basis_bits=16, coef_bits=16)), scale=data.scale)
    assert torch.allclose(fp32, fp16, atol=2e-2)


def test_every_default_variant_estimates_on_random_data():
    data = _data(p=8)
    calib_keys = [torch.randn(2, 160, D)]
    res = Resources(page_size=S, rank=4, loki=LokiCalibration.fit(calib_keys),
                    global_bases=GlobalBases.fit(calib_keys, S))
    ex = exact_layer(data)
    for name in FidelityConfig().selectors:
        est = estimate(variant(name), data, res, ex)
        assert est.scores.shape == ex.lse.shape and torch.isfinite(est.scores).all(), name
        if est.logits is not None:
            assert est.logits.shape == ex.logits.shape
    # at full rank and float32 the per-page summary reproduces the exact logits
    full = estimate(variant("locks_r16_b32"), data, res, ex)
    assert torch.allclose(full.logits, ex.logits, atol=1e-3)


def test_variant_names_parse_and_reject():
    assert variant("locks").bits == 4 and variant("locks_int2").bits == 2 and variant("locks_fp32").bits == 32
    v = variant("locks_r4_b8_max_share")
    assert (v.rank, v.bits, v.combine) == (4, 8, "max_share")
    assert variant("oracle_per_head").per_head and variant("oracle_sum_mass").combine == "sum_mass"
    for bad in ("lox", "locks_b3", "locks_r0_b4", "oracle_median"):
        with pytest.raises(ValueError):
            variant(bad)
    with pytest.raises(ValueError, match="budgets"):
        FidelityConfig(budgets=(40,))
    with pytest.raises(ValueError, match="selector"):
        FidelityConfig(selectors=("locks", "nope"))


def test_per_page_energy_is_one_minus_tau_over_total_and_beats_shared_bases():
    pages = torch.randn(2, 10, S, D) * torch.linspace(3, 0.1, D)  # anisotropic keys
    _, dev = centred(pages)
    curve = ladder.page_energy_curve(dev)  # [H, P, S]
    total = (dev.double() ** 2).sum(dim=(-2, -1))
    for r in (1, 4, 8):
        tau = spectral_basis(pages, r)[3]
        assert torch.allclose(curve[..., r - 1], (1 - tau / total).float(), atol=1e-5)
    seq = ladder.shared_energy_curve(dev, torch.linalg.qr(torch.randn(2, D, D))[0].transpose(-1, -2))
    from kvlocks_lab.selectors.shadowkv import sequence_basis
    fitted = ladder.shared_energy_curve(dev, sequence_basis(dev, D))
    assert torch.allclose(fitted[..., -1], torch.ones(()), atol=1e-5)  # full rank captures everything
    for r in range(1, S):
        assert (curve[..., r - 1] >= seq[..., r - 1] - 1e-5).all()  # the page's own basis is optimal
        assert (curve[..., r - 1] >= fitted[..., r - 1] - 1e-5).all()
    by = ladder.energy_by_scope(pages, sequence_basis(dev, D))
    assert by["page"].shape == (2, S) and by["sequence"].shape == (2, D)
    assert torch.allclose(by["sequence"], by["global"])  # the same basis given as global


def test_matched_bytes_axes():
    axes = ladder.bytes_axes(16, 64)
    r = ladder.matched_shared_rank(16, 8, 64)
    assert axes["sequence"][r - 1] <= axes["page"][7] < axes["sequence"][r]


# ----------------------------------------------------------------------------- Theorem 1


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rank", [4, 12, 14])
def test_eta_within_eq7_and_retention_eq8_and_eq9_hold_unquantized(seed, rank):
    data = _data(h=2, p=12, q=4, g=3, seed=seed, spread=1.5)
    ex = exact_layer(data)
    mu, basis, coef, tau, _ = spectral_basis(data.pages, rank)
    est = torch.logsumexp(data.unflatten(page_local_logits(data.flat_queries, mu, basis, coef, data.scale)), -1)
    eta = bounds.eta(est, ex.lse)  # [H, Q]
    assert (eta > 0).all()
    if rank == 14:  # a regime where Eq. 8 says something: exp(-4 eta) well above 0
        assert float(torch.exp(-4 * eta).max()) > 0.4
    assert (eta <= bounds.eq7_bound(data.queries, basis, tau, data.scale) + 1e-5).all()
    radius = bounds.value_radius(data.values)
    for k in (3, 4, 6):
        star = metrics.coverage(ex.share, metrics.selection_mask(ex.lse, k)).mean(-1)
        mask = metrics.selection_mask(est, k)
        got = metrics.coverage(ex.share, mask).mean(-1)
        assert (got >= torch.exp(-4 * eta) * star - 1e-6).all()
        err, _ = metrics.output_errors(ex.share, ex.page_out, ex.out, mask)
        eq9, _ = bounds.eq9_bounds(radius, eta, star)
        assert (err.mean(-1) <= eq9 + 1e-5).all()


def test_eta_by_hand():
    est = torch.tensor([[[0.0, 1.0], [2.0, 3.0]]])
    exact = torch.tensor([[[0.5, 1.0], [2.0, 1.0]]])
    assert bounds.eta(est, exact).tolist() == [2.0]


def test_tail_stats_and_page_properties():
    data = _data(p=6)
    sigma = spectral_basis(data.pages, 4)[4]
    props = page_properties(data.pages, sigma, 4)
    norms = data.pages.norm(dim=-1)
    assert torch.allclose(props["norm_range"], norms.amax(-1) - norms.amin(-1))
    assert torch.allclose(props["gap"], (sigma[..., 3] / sigma[..., 4]).log10())
    ts = TailStats()
    ex = exact_layer(data)
    noisy = {4: ex.lse + 0.1 * torch.rand_like(ex.lse), 8: ex.lse + 0.01}
    row = ts.add(ex.lse, ex.lse, noisy, props)
    assert row["int8_vs_fp32"]["max"] == pytest.approx(0.01, abs=1e-6)
    s = ts.summary()
    assert s["quantiles"]["int4_vs_fp32"]["max"] <= 0.1 + 1e-6
    assert set(s["predictability"]) == {"norm_range", "gap", "sigma1"}


# ----------------------------------------------------------------------------- adaptive precision


def _spread_pages(h=2, p=20, seed=4):
    """Pages whose key-norm ranges differ: every page's keys get their own scales."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h, p, S, D, generator=gen)
    return keys * (0.5 + 3 * torch.rand(h, p, S, 1, generator=gen))


def test_adaptive_bytes_by_hand():
    cfg = LocksConfig(page_size=16, rank=8, budget=32)
    # head_dim 64: int4 basis 64*8/2 = 256 B, int8 basis 512 B; coefficients 16*8 = 128 B; centroid 64 B;
    # scales float16: 8 (basis) + 16 (coefficient rows) + 1 (centroid) = 25 -> 50 B; flag 1 B
    assert adaptive.summary_bytes(cfg, 64, 4) == (448, 50) and adaptive.summary_bytes(cfg, 64, 8) == (704, 50)
    b = adaptive.mixed_bytes(cfg, 64, 0.25)  # a quarter of the pages int8: 448 + 0.25 * 256 = 512
    assert (b["payload"], b["scales"], b["flags"], b["total"]) == (512.0, 50.0, 1, 563.0)
    assert (b["int4"], b["int8"]) == (498, 754)
    # and on built summaries: 3 of 12 pages promoted, head_dim 32 (int4 basis 128 B, int8 256 B)
    pages = _spread_pages(h=1, p=12)
    promoted = torch.zeros(1, 12, dtype=torch.bool)
    promoted[0, [1, 5, 7]] = True
    summ = adaptive.build_adaptive(pages, cfg, promoted)
    assert summ.low.bytes_per_page() == adaptive.summary_bytes(cfg, D, 4) == (128 + 128 + 32, 50)
    assert summ.high.bytes_per_page() == adaptive.summary_bytes(cfg, D, 8) == (256 + 128 + 32, 50)
    got = summ.bytes_per_page()
    assert (got["payload"], got["scales"], got["total"]) == (288 + 32.0, 50.0, 288 + 32 + 50 + 1.0)
    res = Resources(page_size=S, rank=8)
    assert bytes_per_page(variant("locks_adapt75"), res, 64) == 563.0  # nominal share 1 - 0.75
    assert bytes_per_page(variant("locks_adapt90"), res, 64, promoted_share=0.25) == 563.0


def test_adaptive_basis_is_int8_above_the_threshold_and_int4_below():
    pages = _spread_pages()
    cfg = LocksConfig(page_size=S, rank=8, budget=32)
    promoted = adaptive.promote(pages, 0.8)
    norms = pages.norm(dim=-1)
    rng = (norms.amax(-1) - norms.amin(-1)).double().numpy()  # [H, P]
    want = rng > np.percentile(rng, 80, axis=-1, keepdims=True)
    assert promoted.numpy().tolist() == want.tolist()
    assert promoted.sum(-1).tolist() == [4, 4]  # 20 pages, strictly above the 0.8 quantile
    summ = adaptive.build_adaptive(pages, cfg, promoted)
    int4 = build_summaries(pages, cfg.replace(basis_bits=4))
    int8 = build_summaries(pages, cfg.replace(basis_bits=8))
    basis = summ.basis_float()
    assert torch.equal(basis[promoted], int8.basis_float()[promoted])
    assert torch.equal(basis[~promoted], int4.basis_float()[~promoted])
    assert not torch.equal(int4.basis_float()[promoted], int8.basis_float()[promoted])  # the check can fail
    for name in ("coef_float", "centroid_float"):  # the same at both precisions
        assert torch.equal(getattr(summ, name)(), getattr(int4, name)())
        assert torch.equal(getattr(int8, name)(), getattr(int4, name)())


def test_adaptive_causal_and_random_rules():
    x = torch.tensor([[1.0, 3.0, 2.0, 5.0, 0.0, 4.0, 4.5, 6.0]])  # norm ranges of one head
    pages = torch.zeros(1, 8, S, D)
    pages[..., 0, 0] = x  # one key of norm x, the others 0: range = x
    assert torch.allclose(adaptive.norm_range(pages), x)
    want = [bool(x[0, j] > np.percentile(x[0, : j + 1].numpy(), 50)) for j in range(8)]
    assert want == [False, True, False, True, False, True, True, True]
    assert adaptive.promote(pages, 0.5, "causal")[0].tolist() == want
    prefill = adaptive.promote(pages, 0.5, "prefill")
    assert prefill[0].tolist() == [False, False, False, True, False, True, True, True]  # above the median 3.5
    calib = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])  # 0.5 quantile 2.5, the same for every head
    assert adaptive.promote(pages, 0.5, "calib", calib=calib)[0].tolist() == (x[0] > 2.5).tolist()
    keys = torch.zeros(2, 2 * S + 5, D)  # two whole pages per head, 5 left-over tokens dropped
    keys[0, 3, 0], keys[1, S + 2, 1], keys[1, 2 * S + 1, 0] = 2.0, -7.0, 100.0
    assert adaptive.calibration_ranges([keys, keys[:1]], S).tolist() == [2.0, 0.0, 0.0, 7.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="calib"):
        adaptive.promote(pages, 0.5, "calib")
    rnd = adaptive.promote(pages, 0.5, "random", seed=3)
    assert rnd.sum() == prefill.sum() and torch.equal(rnd, adaptive.promote(pages, 0.5, "random", seed=3))
    with pytest.raises(ValueError, match="q="):
        adaptive.promote(pages, 1.0)
    with pytest.raises(ValueError, match="rule"):
        adaptive.promote(pages, 0.5, "largest")
    with pytest.raises(ValueError, match="promoted"):
        adaptive.build_adaptive(pages, LocksConfig(page_size=S, rank=8, budget=32), prefill.float())


def test_adaptive_variant_scores_match_int4_and_int8_pagewise():
    data = _data(p=12, spread=1.0)
    gen = torch.Generator().manual_seed(9)
    scaled = data.keys * (0.5 + 3 * torch.rand(2, 12, 1, 1, generator=gen)).repeat_interleave(S, 1).squeeze(-1)
    data = LayerData(keys=scaled, values=data.values, queries=data.queries, scale=data.scale, page_size=S, layer=0)
    res = Resources(page_size=S, rank=8)
    ex = exact_layer(data)
    est = estimate(variant("locks_adapt75"), data, res, ex)
    p4, p8 = estimate(variant("locks"), data, res, ex), estimate(variant("locks_int8"), data, res, ex)
    promoted = est.promoted[:, None, None, :].expand_as(est.scores)  # [H, Q, G, P]
    assert 0 < int(est.promoted.sum()) < est.promoted.numel()
    assert torch.allclose(est.scores[promoted], p8.scores[promoted], atol=1e-5)
    assert torch.allclose(est.scores[~promoted], p4.scores[~promoted], atol=1e-5)
    v = variant("locks_adapt90_causal_max_share")
    assert (v.adapt, v.adapt_rule, v.combine, v.bits) == (90, "causal", "max_share", 4)
    assert variant("locks_adapt80_calib").adapt_rule == "calib"
    for bad in ("locks_adapt0", "locks_adapt100", "locks_adapt", "locks_adapt90_oracle"):
        with pytest.raises(ValueError):
            variant(bad)


def test_tail_stats_with_an_adaptive_variant():
    data = _data(p=6)
    props = page_properties(data.pages, spectral_basis(data.pages, 4)[4], 4)
    ex = exact_layer(data)
    noisy = {4: ex.lse + 0.1, 8: ex.lse + 0.01}
    flags = torch.zeros(2, 6, dtype=torch.bool)
    flags[:, 0] = True
    adapt = ex.lse + 0.05 * torch.rand(ex.lse.shape, generator=torch.Generator().manual_seed(1))
    # 40 errors kept, fewer than a unit's 108: the draws matter
    plain, with_extra, with_two = TailStats(sample=40), TailStats(sample=40), TailStats(sample=40)
    for _ in range(2):
        plain.add(ex.lse, ex.lse, noisy, props)
        row = with_extra.add(ex.lse, ex.lse, noisy, props, extra={"adapt80": (adapt, flags)})
        with_two.add(ex.lse, ex.lse, noisy, props, extra={"adapt70": (adapt * 1.01, flags), "adapt80": (adapt, flags)})
    assert row["adapt80_vs_fp32"]["max"] == pytest.approx(float((adapt - ex.lse).max()), abs=1e-6)
    a, b, c = plain.summary(), with_extra.summary(), with_two.summary()
    for k, q in a["quantiles"].items():  # the other comparisons draw the same samples
        assert b["quantiles"][k] == q
    assert c["quantiles"]["adapt80_vs_fp32"] == b["quantiles"]["adapt80_vs_fp32"]  # and adding a variant neither
    assert b["adaptive"]["adapt80"]["promoted_share"] == pytest.approx(1 / 6)
    assert b["page_quantiles"]["adapt80"]["max"] == pytest.approx(float((adapt - ex.lse).mean(dim=(1, 2)).max()))


# ----------------------------------------------------------------------------- capture files


def _capture(n_pages=3, carriers=(5, 17)):
    gen = torch.Generator().manual_seed(0)
    return ActivationCapture(keys=torch.randn(2, 3, n_pages * S, D, generator=gen),
                             values=torch.randn(2, 3, n_pages * S, D, generator=gen),
                             queries=torch.randn(2, 3, 3, 4, D, generator=gen), scales=torch.full((2,), D**-0.5),
                             page_size=S, carrier_tokens=carriers, meta={"name": "x", "prefix_len": n_pages * S})


def test_capture_round_trip(tmp_path):
    cap = _capture()
    save_capture(tmp_path / "c.safetensors", cap)
    back = load_capture(tmp_path / "c.safetensors")
    for name in ("keys", "values", "queries", "scales"):
        assert torch.equal(getattr(back, name), getattr(cap, name))
    assert back.carrier_tokens == (5, 17) and back.carrier_pages == (0, 1) and back.meta == cap.meta
    k, v, q, scale = back.layer(1)
    assert q.shape == (3, 4, 3, D) and torch.equal(q[:, 2, 1], cap.queries[1, :, 1, 2])
    assert scale == pytest.approx(D**-0.5)


def test_corrupt_or_foreign_capture_files_are_rejected(tmp_path):
    path = tmp_path / "c.safetensors"
    save_capture(path, _capture())
    raw = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    flipped = bytearray(raw)
    flipped[-100] ^= 0xFF  # inside the last tensor's data
    (tmp_path / "flip.safetensors").write_bytes(bytes(flipped))
    (tmp_path / "pickle.safetensors").write_bytes(pickle.dumps({"keys": [1, 2]}))
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 64)
    for name, match in (("trunc", "readable"), ("flip", "checksum"), ("pickle", "readable"), ("garbage", "readable")):
        with pytest.raises(ValueError, match=match):
            load_capture(tmp_path / f"{name}.safetensors")
    from safetensors.torch import save_file
    cap = _capture()
    tensors = {n: getattr(cap, n) for n in ("keys", "values", "queries", "scales")}
    save_file(tensors, str(tmp_path / "foreign.safetensors"), metadata={"format": "other"})
    with pytest.raises(ValueError, match="format"):
        load_capture(tmp_path / "foreign.safetensors")
    with pytest.raises(FileNotFoundError):
        load_capture(tmp_path / "missing.safetensors")


def test_capture_validation():
    with pytest.raises(ValueError, match="carrier"):
        _capture(carriers=(48,))
    with pytest.raises(ValueError, match="multiple"):
        ActivationCapture(keys=torch.zeros(1, 1, 20, D), values=torch.zeros(1, 1, 20, D),
                          queries=torch.zeros(1, 1, 1, 1, D), scales=torch.ones(1), page_size=S)
    bad = torch.zeros(1, 1, S, D)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        ActivationCapture(keys=bad, values=torch.zeros(1, 1, S, D), queries=torch.zeros(1, 1, 1, 1, D),
                          scales=torch.ones(1), page_size=S)
    with pytest.raises(ValueError, match="float32"):
        ActivationCapture(keys=torch.zeros(1, 1, S, D).half(), values=torch.zeros(1, 1, S, D),
                          queries=torch.zeros(1, 1, 1, 1, D), scales=torch.ones(1), page_size=S)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.model
def test_kvlocks_fidelity_end_to_end(tmp_path, capsys):
    from kvlocks.cli import main

    out = tmp_path / "fid"
    rc = main(["fidelity", "--tasks", "niah_single_text", "--text-records", "1", "--length", "320", "--queries", "4",
               "--layers", "0,9", "--budgets", "32,64", "--calib-tokens", "128", "--captures", str(tmp_path / "cap"),
               "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for png in ("share_scatter", "carrier_vs_budget", "coverage_vs_budget", "error_ladder", "energy_scope",
                "eta_bound", "quant_tails"):
        assert (out / f"{png}.png").stat().st_size > 1000
    assert summary["calibration"]["shared_sentences_with_prompts"] == 0
    assert summary["layers"] == [0, 9] and summary["commit"] and summary["versions"]["torch"]
    needle = next(p for p in summary["prompts"] if p["kind"] == "needle")
    assert needle["carrier_pages"] and all(t < needle["prefix_len"] for t in needle["carrier_tokens"])
    sel = summary["selectors"]
    assert set(sel) == set(FidelityConfig().selectors)
    for b in ("32", "64"):
        for name, entry in sel.items():
            cell = entry["budgets"][b]
            assert 0.0 <= cell["coverage"] <= 1.0 + 1e-6 and cell["carrier"] is not None
            if name != "oracle_per_head":  # the exact mean_share oracle is the best shared selection
                assert cell["coverage"] <= sel["oracle"]["budgets"][b]["coverage"] + 1e-6, name
    assert sel["oracle"]["scores"]["lse_mae"]["mean"] == 0.0
    assert summary["bounds"]["eta"]["eq7_holds"] == 1.0
    assert all(r["eq8_holds"] == 1.0 for r in summary["bounds"]["retention"].values())
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"scores", "selection", "eta", "retention", "energy", "quant"}
    # the capture files are on disk, validated on load, and carry the needle's pages
    from kvlocks_lab.fidelity.capture import load_capture as load
    cap = load(tmp_path / "cap" / f"{needle['name']}.safetensors")
    assert cap.carrier_pages == tuple(needle["carrier_pages"]) and cap.keys.shape[2] == needle["prefix_len"]
    assert "coverage" in capsys.readouterr().out


def test_without_calibration_prose_the_selectors_fitted_on_it_are_refused_and_the_others_run(tmp_path):
    """``--calib-tokens 0`` (long prompts may use up the prose): no calibration prompt is captured;
    Loki, the global bases and the ``calib`` adaptive rule are refused by name."""
    import pytest

    from kvlocks.cli import main

    for bad in ("loki", "global", "locks_adapt90_calib"):
        with pytest.raises(ValueError, match=rf"calib_tokens=0: selectors \['{bad}'\]"):
            FidelityConfig(selectors=("oracle", bad), calib_tokens=0)
    FidelityConfig(selectors=("oracle", "locks_adapt90_causal"), calib_tokens=0)
    out, cap = tmp_path / "fid", tmp_path / "cap"
    rc = main(["fidelity", "--tasks", "niah_single_text", "--samples", "1", "--text-records", "0", "--length", "320",
               "--queries", "4", "--layers", "0", "--budgets", "32,64", "--calib-tokens", "0",
               "--selectors", "oracle,locks,centroid_rerank4", "--captures", str(cap), "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["calibration"] == {"tokens": 0, "shared_sentences_with_prompts": 0}
    assert sorted(p.name for p in cap.iterdir()) == [f"{summary['prompts'][0]['name']}.safetensors"]
    for b in ("32", "64"):
        best = summary["selectors"]["oracle"]["budgets"][b]["coverage"]
        assert all(summary["selectors"][n]["budgets"][b]["coverage"] <= best + 1e-6 for n in ("locks", "centroid_rerank4"))


def test_rerank_selection_mask_is_the_oracle_when_candidates_cover_the_pages_and_the_library_rule_otherwise():
    import torch

    from kvlocks.config import LocksConfig
    from kvlocks.scoring.reference import combine_group
    from kvlocks.selection.rerank import rerank_ranking
    from kvlocks.selection.topk import select_top_pages
    from kvlocks_lab.fidelity.metrics import selection_mask
    from kvlocks_lab.fidelity.variants import variant
    from kvlocks_lab.selectors.hier import Groups, group_summaries, hierarchical_ranking

    gen = torch.Generator().manual_seed(0)
    q, keys = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 20 * 16, 16, generator=gen)
    exact = torch.logsumexp(torch.einsum("hgd,hnd->hgn", q, keys).unflatten(-1, (20, 16)), dim=-1)  # [H, G, P]
    est = exact + 0.7 * torch.randn(exact.shape, generator=gen)  # a noisy estimate
    assert torch.equal(selection_mask(est, 4, exact=exact, rerank=64), selection_mask(exact, 4))
    cfg = LocksConfig(budget=64, rerank=3)
    lib = rerank_ranking(q, keys, est, combine_group(est, "mean_share"), cfg, scale=1.0, total_pages=20)
    want = torch.zeros(3, 20, dtype=torch.bool).scatter(-1, select_top_pages(lib, 20, 4), True)
    assert torch.equal(selection_mask(est, 4, exact=exact, rerank=3), want.unsqueeze(-2).expand(3, 2, 20))
    assert variant("locks_rerank4").rerank == 4 and variant("locks_rerank4").family == "locks"
    with pytest.raises(ValueError, match="candidate multiple"):
        variant("locks_rerank1")
    # a candidate floor: 2 x (k - 2) = 4 candidates, at least 18 (every free page) -> the oracle's
    assert not torch.equal(selection_mask(est, 4, exact=exact, rerank=2), selection_mask(exact, 4))
    assert torch.equal(selection_mask(est, 4, exact=exact, rerank=2, rerank_min=18), selection_mask(exact, 4))
    lib = rerank_ranking(q, keys, est, combine_group(est, "mean_share"), LocksConfig(budget=64, rerank=5),
                         scale=1.0, total_pages=20)  # 5 x 2 = 10 candidates, as a floor of 10 over 2 x 2
    want = torch.zeros(3, 20, dtype=torch.bool).scatter(-1, select_top_pages(lib, 20, 4), True)
    got = selection_mask(est, 4, exact=exact, rerank=2, rerank_min=10)
    assert torch.equal(got, want.unsqueeze(-2).expand(3, 2, 20))
    v = variant("centroid_rerank16_min256")
    assert (v.family, v.rerank, v.rerank_min) == ("centroid", 16, 256) and variant("centroid_rerank8").rerank_min == 0


def test_hierarchical_selection_mask_is_the_library_rule():
    import torch

    from kvlocks.config import LocksConfig
    from kvlocks.scoring.reference import score_pages_from_summaries
    from kvlocks.selection.topk import select_top_pages
    from kvlocks_lab.fidelity.metrics import selection_mask
    from kvlocks_lab.fidelity.variants import variant
    from kvlocks_lab.selectors.hier import Groups, group_summaries, hierarchical_ranking

    gen = torch.Generator().manual_seed(4)
    q, keys = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 24 * 16, 16, generator=gen)
    cfg, groups = LocksConfig(budget=64, rank=4, rerank=0), Groups(pages=4, keep=1, rank=4)
    gscores = score_pages_from_summaries(q, group_summaries(keys, cfg, groups), scale=0.25)  # [2, 3, 6]
    est = torch.randn(2, 3, 24, generator=gen)
    ranking, _ = hierarchical_ranking(est, gscores, cfg, groups)
    want = torch.zeros(2, 24, dtype=torch.bool).scatter(-1, select_top_pages(ranking, 24, 4), True)
    got = selection_mask(est, 4, group_scores=gscores, group_pages=4, group_keep=1)
    assert torch.equal(got, want.unsqueeze(-2).expand(2, 3, 24))
    v = variant("locks_hier8_k2")
    assert (v.family, v.group_pages, v.group_keep, v.group_rank) == ("locks", 8, 2, None)
    assert variant("locks_hier16").group_keep == 1 and variant("locks_hier16_k2_r4").group_rank == 4
    for bad in ("locks_hier1", "locks_hier16_k2_r0", "locks_hier16_r17"):
        with pytest.raises(ValueError, match="group pages"):
            variant(bad)


def test_cascade_reranks_the_coarse_candidates_with_the_runs_locks_estimates():
    from kvlocks_lab.fidelity.measure import LayerMeasure

    data = _data(p=24, seed=5)
    res = Resources(page_size=S, rank=4)
    names = ["locks", "locks_r1_b4", "locks_cascade64_r1", "locks_cascade2_r4", "locks_cascade2_r1"]
    lm = LayerMeasure(data, [0, 1], res, budgets=(64,), variants=names, base={}, hot_share=0.5,
                      kendall_stride=1, scatter_pages=0, rng=np.random.default_rng(0))
    lm.exact = exact_layer(data)
    k = 64 // S

    def mask(name):
        v = variant(name)
        est = lm.estimate(name)
        return metrics.selection_mask(est.scores, k, exact=lm._rerank_scores(v), rerank=v.rerank)

    flat, coarse = mask("locks"), mask("locks_r1_b4")
    # candidates covering every page, or a coarse tier equal to the fine one: flat LOCKS's selection
    assert torch.equal(mask("locks_cascade64_r1"), flat)
    assert torch.equal(mask("locks_cascade2_r4"), flat)
    # a narrow cascade keeps only pages among the coarse tier's best 2 (k - 2) (plus sink and recent)
    cand = metrics.selection_mask(lm.estimate("locks_r1_b4").scores, 2 + 2 * (k - 2))
    assert not (mask("locks_cascade2_r1") & ~cand).any() and not torch.equal(flat, coarse)
    v = variant("locks_cascade8_r2")
    assert (v.family, v.rank, v.rerank, v.cascade) == ("locks", 2, 8, True)
    for bad in ("locks_cascade1_r1", "locks_cascade4_r0", "locks_cascade4_r17"):
        with pytest.raises(ValueError, match="coarse rank"):
            variant(bad)
