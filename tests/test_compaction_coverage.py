"""The coverage guard (ridge leverage of keys) and the value anchor of the refit, against
independent float64 references and a planted key no reference query reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvlocks.compaction import CompactionConfig
from kvlocks.compaction.api import compact_head, compact_layer
from kvlocks.compaction.batched import prepare_layer, refit_batched
from kvlocks.compaction.select import coverage_scores, select_attention
from kvlocks.compaction.values import attention_weights, refit_values

PLANTED = 15


def planted():
    """T = 20 keys in D = 2: ten broad keys [0, 3], one planted key [10, 0] (position 15), zeros
    elsewhere; 200 context rows [0, 1] read the broad keys and give the planted key the weight
    1 / (10 e^3 + 10) = 5e-4 (scale 1), below every broad key and tied with the zeros on RMS."""
    keys = torch.zeros(20, 2, dtype=torch.float64)
    keys[:10, 1] = 3.0
    keys[PLANTED, 0] = 10.0
    q = torch.tensor([[0.0, 1.0]], dtype=torch.float64).expand(200, 2)
    return keys, q


def _leverage_numpy(keys: np.ndarray, ridge: float) -> np.ndarray:
    kc = keys - keys.mean(axis=0)
    g = kc.T @ kc
    lam = ridge * np.trace(g) / g.shape[0]
    return np.einsum("td,de,te->t", kc, np.linalg.inv(g + lam * np.eye(g.shape[0])), kc)


@pytest.mark.parametrize("ridge", [1e-3, 0.5])
def test_coverage_scores_match_the_closed_form(ridge):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 40, 6, generator=gen, dtype=torch.float64) * torch.tensor([1, 2, 3, 0.1, 5, 1.0])
    got = coverage_scores(keys, ridge)
    for h in range(3):
        want = _leverage_numpy(keys[h].numpy(), ridge)
        np.testing.assert_allclose(got[h].numpy(), want, rtol=1e-5, atol=1e-7)
        # sum of leverages = tr(G (G + lam I)^-1) = sum over eigenvalues e / (e + lam)
        kc = keys[h].numpy() - keys[h].numpy().mean(axis=0)
        eig = np.linalg.eigvalsh(kc.T @ kc)
        lam = ridge * eig.sum() / 6
        assert float(got[h].sum()) == pytest.approx(float((eig / (eig + lam)).sum()), rel=1e-5)
    assert bool((got >= 0).all()) and bool((got < 1).all())
    with pytest.raises(ValueError, match="ridge"):
        coverage_scores(keys, 0.0)


def test_coverage_guard_keeps_the_planted_key_rms_drops_it():
    keys, q = planted()
    lev = coverage_scores(keys)
    assert int(lev.argmax()) == PLANTED  # the one key whose direction no other key shares
    assert select_attention(keys, q, 5, scale=1.0).tolist() == [0, 1, 2, 3, 4]
    kept = select_attention(keys, q, 5, scale=1.0, coverage_share=0.2)  # one slot
    assert kept.tolist() == [0, 1, 2, 3, PLANTED]


def _normal_equations(p, o, v0, ridge, anchor_weight):
    """(P^T P + (lam + mu) I) V = P^T O + mu V0, lam and mu relative to the mean diagonal."""
    p, o, v0 = (x.numpy().astype(np.float64) for x in (p, o, v0))
    gram = p.T @ p
    diag = np.trace(gram) / gram.shape[0]
    lam, mu = ridge * diag, anchor_weight * diag
    return np.linalg.solve(gram + (lam + mu) * np.eye(gram.shape[0]), p.T @ o + mu * v0)


@pytest.mark.parametrize("ridge,weight", [(1e-6, 1e-3), (0.0, 1e-2), (1e-3, 0.0), (0.0, 5.0)])
def test_anchored_refit_solves_its_normal_equations(ridge, weight):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(30, 4, generator=gen, dtype=torch.float64)
    keys = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    target = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    v0 = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    p = attention_weights(q, keys, scale=0.5, dtype=torch.float64)
    want = _normal_equations(p, target, v0, ridge, weight)
    got = refit_values(keys, q, target, scale=0.5, ridge=ridge, anchor=v0, anchor_weight=weight)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
    batch = refit_batched(p[None].expand(2, -1, -1), target[None].expand(2, -1, -1), ridge,
                          v0[None].expand(2, -1, -1), weight)
    np.testing.assert_allclose(batch[1].numpy(), want, rtol=1e-4, atol=1e-5)


def test_anchor_keeps_an_unread_value_and_leaves_read_ones_to_the_fit():
    keys, _ = planted()
    keys[PLANTED, 0] = -30.0  # rows [1, 1] give it logit -30 against 3: weight ~5e-19, no row reads it
    q = torch.ones(200, 2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    w = attention_weights(q, keys, scale=1.0, dtype=torch.float64)
    target = w @ values
    for weight in (1e-3, 0.0):
        cfg = CompactionConfig(method="drop_refit", coverage_share=0.2, value_anchor=weight)
        head = compact_head(keys, values, q, 5, cfg, scale=1.0)
        assert head.indices.tolist() == [0, 1, 2, 3, PLANTED]  # the coverage guard's one slot
        # its normal-equation row decouples: (lam + mu) v = mu v0, so v = mu / (lam + mu) v0
        share = weight / (weight + cfg.ridge)
        np.testing.assert_allclose(head.values[4].numpy(), share * values[PLANTED].numpy(), atol=1e-6)
        # the read keys still reproduce the reference outputs (the pull costs ~ its weight)
        got = attention_weights(q, keys[head.indices], scale=1.0, dtype=torch.float64) @ head.values.double()
        assert float((got - target).norm() / target.norm()) < max(2 * weight, 1e-6)
        # the batched path (all five plain-cache methods share it) gives the same values
        layer = compact_layer(keys.float()[None], values.float()[None], q.float()[None], 5, cfg, scale=1.0)
        np.testing.assert_allclose(layer.values[0].numpy(), head.values.numpy(), rtol=1e-4, atol=1e-5)


def test_prepare_layer_computes_coverage_only_when_asked():
    keys, q = planted()
    k, v = keys.float()[None], torch.ones(1, 20, 3)
    assert prepare_layer(k, v, q.float()[None], CompactionConfig(coverage_share=0.0), 1.0).coverage is None
    fit = prepare_layer(k, v, q.float()[None], CompactionConfig(coverage_share=0.3), 1.0)
    torch.testing.assert_close(fit.coverage, coverage_scores(k))


@pytest.mark.parametrize("kwargs,field", [
    ({"coverage_share": -0.1}, "coverage_share"), ({"coverage_share": 1.2}, "coverage_share"),
    ({"question_share": 0.6, "coverage_share": 0.5}, "coverage_share"),
    ({"value_anchor": -1.0}, "value_anchor"), ({"value_anchor": float("inf")}, "value_anchor"),
])
def test_config_rejects_bad_guard_and_anchor(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CompactionConfig(**kwargs)


def test_config_files_made_without_the_fields_read_as_zero():
    cfg = CompactionConfig(coverage_share=0.1, value_anchor=0.5)
    assert CompactionConfig.from_json(cfg.to_json()) == cfg
    import json
    old = json.loads(CompactionConfig().to_json())
    del old["coverage_share"], old["value_anchor"]
    back = CompactionConfig.from_json(json.dumps(old))
    assert back.coverage_share == 0.0 and back.value_anchor == 0.0
