"""The batched layer path against the per-head path and closed forms; repeat spans; the capture cache."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from kvlocks.compaction import CompactionConfig, compact_head, compact_layer, exact_attention
from kvlocks.compaction import batched
from kvlocks.integrations.hf.compaction.capture import _GrowingLayer
from kvlocks.compaction.fold import fold_direction
from kvlocks.integrations.hf.compaction.passes import QueryPass, repeat_pass, repeat_spans
from kvlocks.compaction.select import attention_scores
from kvlocks.compaction.values import refit_values


def _layer(h=3, num=48, d=8, n=64, seed=0):
    """Keys with a few dominant directions and queries with a nonzero mean (like a model's)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, num, d, generator=g) * 1.5
    v = torch.randn(h, num, d, generator=g)
    q = torch.randn(h, n, d, generator=g) + 0.5
    return k, v, q


def _bias_objective(k, idx, q, beta) -> float:
    """sum_j ((sum_i exp(l_ji + beta_i)) / Z_j - 1)^2 over kept i, Z_j over all keys (float64)."""
    lg = (q.double() @ k.double().T) / math.sqrt(k.shape[1])  # [n, T]
    z = torch.logsumexp(lg, dim=1)
    kept = torch.logsumexp(lg[:, idx] + beta.double()[None], dim=1)
    return float(((kept - z).exp() - 1.0).square().sum())


@pytest.mark.parametrize("method", batched.BATCHED_METHODS)
@pytest.mark.parametrize("num, t, n", [(48, 5, 64), (17, 16, 40), (30, 1, 9), (40, 12, 7)])
def test_batched_layer_equals_per_head_path(method, num, t, n):
    k, v, q = _layer(num=num, n=n, seed=num + t)
    cfg = CompactionConfig(method=method, round_dtype="float32", max_queries=50, seed=3)
    layer = compact_layer(k, v, q, t, cfg)
    d = k.shape[2]
    assert layer.keys.shape == (3, t, d + (method == "rank1")) and layer.indices.shape == (3, t)
    for h in range(3):
        ref = compact_head(k[h], v[h], q[h], t, cfg)
        assert torch.equal(layer.indices[h], ref.indices)
        qs = batched.subsample_rows(q, 50, 3)[h]
        if method != "fold" or qs.shape[0] >= t:
            torch.testing.assert_close(layer.keys[h, :, :d] if method != "fold" else layer.keys[h],
                                       ref.keys[:, :d] if method != "fold" else ref.keys,
                                       rtol=1e-5, atol=1e-5)
        # with n < t beta is not unique (nor are folded keys): compare objectives and outputs
        kk, bb = (ref.keys[:, :d], ref.keys[:, d]) if method == "rank1" else (ref.keys, ref.beta)
        lk, lb = (layer.keys[h, :, :d], layer.keys[h, :, d]) if method == "rank1" else \
            (layer.keys[h], None if layer.beta is None else layer.beta[h])
        out_ref, _ = exact_attention(qs, kk, ref.values, bias=bb)
        out, _ = exact_attention(qs, lk, layer.values[h], bias=lb)
        if method != "drop" or qs.shape[0] >= t:  # drop reads AM's values without its beta
            torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
        if ref.fitted_bias is not None:  # the same bias-fit optimum (unique when n >= t)
            obj = [_bias_objective(k[h], ref.indices, qs, b) for b in (layer.fitted_bias[h], ref.fitted_bias)]
            assert abs(obj[0] - obj[1]) <= 1e-6 * obj[1] + 1e-9
            if qs.shape[0] >= t:
                torch.testing.assert_close(layer.fitted_bias[h], ref.fitted_bias, rtol=1e-4, atol=1e-4)
    assert (layer.beta is not None) == (method == "am")
    assert (layer.u is not None) == (method == "fold")


def test_full_pass_against_dense_softmax():
    k, v, q = _layer(h=1, num=33, n=21)
    s = 0.3
    target, scores, z, shift = batched.full_pass(k[0], v[0], q[0], s)
    logits = (q[0].double() @ k[0].double().T) * s  # [n, T]
    p = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(target.double(), p @ v[0].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores, attention_scores(k[0], q[0], scale=s), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(shift, logits.max(dim=1).values, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, (logits - shift[:, None]).exp().sum(1), rtol=1e-6, atol=1e-6)
    work = torch.full((21, 33), float("nan"))  # a reused workspace gives the same result
    again = batched.full_pass(k[0], v[0], q[0], s, out=work)
    assert torch.equal(again[0], target) and torch.equal(again[1], scores)


def test_fold_directions_and_refit_against_the_per_head_closed_forms():
    k, v, q = _layer(h=4, n=50)
    u = batched.fold_directions(q, 1e-2)
    for h in range(4):
        torch.testing.assert_close(u[h], fold_direction(q[h], fold_lambda=1e-2), rtol=1e-5, atol=1e-6)
        assert abs(float(q[h].double().mean(0) @ u[h].double()) - 1.0) < 1e-5  # mean q.u = 1
    keys = k[:, :6]
    target = torch.randn(4, 50, 8, generator=torch.Generator().manual_seed(1))
    p = torch.softmax((q.double() @ keys.double().transpose(1, 2)) / math.sqrt(8), dim=-1)
    for ridge in (1e-6, 0.0):
        got = batched.refit_batched(p, target, ridge)
        for h in range(4):
            ref = refit_values(keys[h], q[h], target[h], ridge=ridge)
            torch.testing.assert_close(got[h], ref, rtol=1e-4, atol=1e-5)


def test_refit_without_ridge_is_the_least_squares_solution():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(2, 30, 5, generator=g, dtype=torch.float64), dim=-1)
    o = torch.randn(2, 30, 3, generator=g)
    got = batched.refit_batched(p, o, 0.0).double()
    for h in range(2):  # normal equations P^T (P x - o) = 0
        resid = p[h].T @ (p[h] @ got[h] - o[h].double())
        assert float(resid.abs().max()) < 1e-5


def test_unsupported_configs_take_the_per_head_path():
    k, v, q = _layer(num=24, n=30)
    for cfg in (CompactionConfig(method="fold", selection="omp"), CompactionConfig(method="merge_fold")):
        assert not batched.supports(cfg)
        layer = compact_layer(k, v, q, 4, cfg)
        ref = compact_head(k[1], v[1], q[1], 4, cfg)
        assert torch.equal(layer.keys[1], ref.keys) and torch.equal(layer.values[1], ref.values)
    with pytest.raises(ValueError, match="batched compaction: method='merge_fold'"):
        batched.compact_layer_batched(k, v, q, 4, CompactionConfig(method="merge_fold"))


def test_repeat_spans_hand_computed():
    assert repeat_spans(100, 1536, 256) == [0]  # short prefix: repeated whole
    assert repeat_spans(4096, 1536, 256) == [0, 768, 1536, 2304, 3072, 3840]  # 6 spans, even
    assert repeat_spans(1000, 300, 300) == [350]  # one span: the middle
    starts = repeat_spans(2001, 1000, 256)
    assert len(starts) == 4 and starts[0] == 0 and starts[-1] + 256 == 2001


def test_repeat_pass_segments_place_each_span_as_in_the_whole_repeat():
    head = torch.tensor([[90, 91, 92]])
    prefix = torch.arange(10, 30)[None]  # T = 20
    whole = repeat_pass(head, prefix, 20, 4)
    assert whole.segments == () and whole.ids.tolist() == [[90, 91, 92] + list(range(10, 30))]
    p = repeat_pass(head, prefix, 8, 4)  # two spans of 4, at 0 and 16
    assert p.segments == ((7, 20), (7, 36))
    assert p.ids.tolist() == [[90, 91, 92, 10, 11, 12, 13, 90, 91, 92, 26, 27, 28, 29]]
    # whole repeat: token prefix[i] sits at T + 3 + i; in the span at 16, prefix[16] sits at
    # 36 + 3 = 39 = T + 3 + 16: the same distance from its original
    with pytest.raises(ValueError, match="segments"):
        QueryPass("x", prefix, segments=((5, 0),))


def test_growing_layer_matches_a_dynamic_layer():
    g = torch.Generator().manual_seed(5)
    ref, grow = DynamicLayer(), _GrowingLayer()
    for length, crop in ((300, 0), (1, 0), (7, -5), (500, -400), (1, 0)):
        kv = torch.randn(1, 2, length, 4, generator=g), torch.randn(1, 2, length, 4, generator=g)
        a, b = ref.update(*kv), grow.update(*kv)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        if crop:
            ref.crop(crop)
            grow.crop(crop)
            assert torch.equal(ref.keys, grow.keys) and grow.get_seq_length() == ref.get_seq_length()


def test_shared_fits_equal_each_method_alone():
    k, v, q = _layer(num=40, n=60, seed=9)
    cfg = CompactionConfig(max_queries=50)
    fit = batched.prepare_layer(k, v, q, cfg)
    for t in (3, 20):
        many = batched.compact_prepared(fit, t, batched.BATCHED_METHODS, cfg)
        for m in batched.BATCHED_METHODS:
            alone = batched.compact_layer_batched(k, v, q, t, cfg.replace(method=m))
            for name, x in alone.items():
                y = many[m][name]
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (m, name)


def test_pool_keeps_question_rows_whole():
    from kvlocks.integrations.hf.compaction.capture import _rows, is_question, pool

    ctx = torch.arange(2 * 30 * 1, dtype=torch.float32).reshape(2, 30, 1)  # [Hkv, 30, 1]
    qst = -1.0 - torch.arange(2 * 4 * 1, dtype=torch.float32).reshape(2, 4, 1)  # [Hkv, 4, 1]
    plain = pool([ctx, qst], 10, 0)
    both = torch.cat([ctx, qst], dim=1)
    assert torch.equal(plain, both[:, _rows(34, 10, 0)])  # no flags: the seeded subsample
    got = pool([ctx, qst], 10, 0, keep=[False, True])
    assert got.shape == (2, 10, 1) and torch.equal(got[:, :4], qst)  # all 4 question rows
    assert torch.equal(got[:, 4:], ctx[:, _rows(30, 6, 0)])  # the rest fills the cap
    assert torch.equal(pool([qst], 3, 0, keep=[True]), qst[:, :3])
    assert is_question("question_0") and not is_question("self_study_0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu/gpu_tests.sh runs it)")
@pytest.mark.parametrize("method", ["fold", "am", "drop_refit", "rank1"])
def test_layer_fit_on_cuda_equals_the_cpu_fit(method):
    """``kvlocks compact --device cuda`` fits every layer on the GPU: same kept keys as the CPU's fit
    and the same served attention output on held-out queries (float32 rounding apart)."""
    k, v, q = _layer(h=4, num=400, d=64, n=512, seed=3)
    held = torch.randn(4, 64, 64, generator=torch.Generator().manual_seed(9)) + 0.5
    cfg = CompactionConfig(method=method, ratio=0.1)
    cpu = compact_layer(k, v, q, 40, cfg)
    gpu = compact_layer(k.cuda(), v.cuda(), q.cuda(), 40, cfg)
    assert gpu.keys.is_cuda
    same = (gpu.indices.cpu() == cpu.indices).float().mean()
    assert same >= 0.95, f"{same:.3f} of the kept positions agree"
    for h in range(4):
        full, _ = exact_attention(held[h], k[h], v[h])
        outs = []
        for layer in (cpu, gpu):
            keys, vals = layer.keys[h].cpu(), layer.values[h].cpu()
            bias = None if layer.beta is None else layer.beta[h].cpu()
            if method == "rank1":
                keys, bias = keys[:, :-1], keys[:, -1]
            outs.append(exact_attention(held[h], keys, vals, bias=bias)[0])
        err = [float((o - full).norm() / full.norm()) for o in outs]
        assert abs(err[1] - err[0]) <= 0.02 * err[0] + 1e-5, (h, err)
