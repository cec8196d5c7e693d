"""The compaction study: its metrics against hand computations, its shared fits against the
per-method path, the bias solvers against each other, and a tiny end-to-end run on the bundled
model checked against an independent recomputation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kvlocks.compaction import CompactionConfig, compact_head, compact_layer, fit_bias
from kvlocks.compaction.api import CompactedHead
from kvlocks.compaction.bias import mass_design, partition_targets
from kvlocks.integrations.hf.compaction.capture import Capture
from kvlocks_lab.compaction_study.config import StudyConfig
from kvlocks_lab.compaction_study.heads import compact_methods, prepare_head
from kvlocks_lab.compaction_study.measure import QU_EDGES, qu_histogram
from kvlocks_lab.compaction_study.metrics import (answer_kl, bound_check, excess_share, median_ratio,
                                              output_error)
from kvlocks_lab.compaction_study.queries import split_queries


def _data(T=60, D=8, n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=g), torch.randn(T, D, generator=g),
            torch.randn(n, D, generator=g) + 0.4)


def test_output_error_matches_hand_computation():
    ref = torch.tensor([[3.0, 4.0], [0.0, 1.0]])  # norms 5 and 1: mean 3
    out = torch.tensor([[3.0, 0.0], [0.0, 1.0]])  # error norms 4 and 0: mean 2
    err, norm = output_error(out, ref)
    assert err == pytest.approx(2 / 3) and norm == pytest.approx(3.0)
    assert output_error(ref, ref) == (0.0, pytest.approx(3.0))
    with pytest.raises(ValueError, match=r"\[n >= 1, Dv\]"):
        output_error(out, ref[:1])


def test_answer_kl_matches_direct_sum():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    p, q = torch.softmax(a.double(), -1).numpy(), torch.softmax(b.double(), -1).numpy()
    direct = np.mean([(p[i] * (np.log(p[i]) - np.log(q[i]))).sum() for i in range(5)])
    assert answer_kl(a, b) == pytest.approx(direct, rel=1e-5)
    assert answer_kl(a, a) == pytest.approx(0.0, abs=1e-6)


def test_median_ratio_and_excess_share_by_hand():
    assert median_ratio([2.0, 3.0, 1.0, 5.0], [1.0, 3.0, 0.0, 5.0]) == pytest.approx(1.0)  # 2, 1, 1
    assert median_ratio([1.0], [0.0]) is None
    # excess 10, 1, 1, 1, 1, 0, -3, 0, 0, 0: the worst 10% (one case) carries 10/14
    assert excess_share([10, 1, 1, 1, 1, 0, -3, 0, 0, 0], 0.1) == pytest.approx(10 / 14)
    assert excess_share([0.0, -1.0]) is None


def test_bound_on_two_keys_matches_closed_form():
    """Two equal keys with beta = +-3 and values e1, -e1: o = tanh(3 c) e1 for c = q . u."""
    d = 4
    u = torch.tensor([1.0, 0.0, 0.0, 0.0])
    keys = torch.zeros(2, d)
    values = torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]])  # D_V = 2
    beta = torch.tensor([3.0, -3.0])
    c = torch.tensor([1.0, 0.9, 1.3, 0.5, 0.0])
    q = c[:, None] * u[None, :]  # q . u = c
    am = CompactedHead(keys=keys, values=values, beta=beta, indices=torch.tensor([0, 1]), u=None,
                       method="am", head_dim_out=d, fitted_bias=beta)
    folded = keys + beta[:, None] * math.sqrt(d) * u[None, :]  # k + beta sqrt(d) u, by hand
    fold = CompactedHead(keys=folded, values=values, beta=None, indices=torch.tensor([0, 1]), u=u,
                         method="fold", head_dim_out=d, fitted_bias=beta)
    chk = bound_check(q, am, fold, d ** -0.5)
    # softmax of logits (3c, -3c) vs (3, -3): outputs tanh(3c) and tanh(3) along e1
    expect = (torch.tanh(3 * c) - math.tanh(3.0)).abs()
    assert torch.allclose(chk["exact"], expect, atol=1e-5)
    assert torch.allclose(chk["bound"], 1.5 * 2 * (c - 1).abs(), atol=1e-6)
    assert chk["exact_holds"] == 5 and chk["n"] == 5
    # this "served" fold has unrounded keys and AM's values, so it reads the same
    assert torch.allclose(chk["deployed"], expect, atol=1e-5)


def test_qu_histogram_counts_every_value():
    x = torch.tensor([-5.0, -1.0, -0.011, 0.0, 0.5, 0.999, 1.0, 7.0])
    h = qu_histogram(x)
    assert len(h) == len(QU_EDGES) + 1 and sum(h) == x.numel()
    assert h[0] == 1 and h[-1] == 2  # -5 below; 1.0 and 7 at or above the last edge
    assert h[1 + 49] == 1 and h[1 + 50] == 1  # -0.011 in [-0.02, 0); 0.0 in [0, 0.02)


@pytest.mark.parametrize("methods", [("am", "fold", "drop", "drop_refit", "rank1", "merge_fold"),
                                     ("fold", "drop_refit")])
def test_shared_fits_equal_per_method_compaction(methods):
    k, v, q = _data()
    k[5] = k[4]  # a duplicate, so merge_fold merges something
    cfg = CompactionConfig(max_queries=150, seed=3)
    fit = prepare_head(k, v, q, cfg, scale=0.3)  # shared by both budgets
    assert fit.queries.shape == (150, 8)
    for t in (9, 4):
        got = compact_methods(fit, t, methods, cfg)
        for m in methods:
            ref = compact_head(k, v, q, t, cfg.replace(method=m), scale=0.3)
            h = got.heads[m]
            for name in ("keys", "values", "beta", "indices", "u", "fitted_bias"):
                a, b = getattr(h, name), getattr(ref, name)
                assert (a is None) == (b is None), (m, name)
                if a is not None:
                    assert torch.equal(a, b), (m, t, name)
            assert got.seconds[m] > 0


def test_bias_solvers_agree_on_a_small_case():
    """kvlocks' active-set fit and scipy's trf and bvls reach the same optimum (1e-8 relative)."""
    from scipy.optimize import lsq_linear

    k, v, q = _data(T=300, D=16, n=400, seed=7)
    idx = torch.arange(0, 300, 6)  # t = 50
    z, shift = partition_targets(k, q)
    a = (mass_design(k[idx], q, shift) / z[:, None]).numpy()
    beta = {"active_set": fit_bias(k, idx, q).double().numpy()}
    for solver in ("trf", "bvls"):
        beta[solver] = np.log(lsq_linear(a, np.ones(a.shape[0]), bounds=(math.exp(-3), math.exp(3)),
                                         method=solver).x)
    obj = {s: float(np.sum((a @ np.exp(b) - 1) ** 2)) for s, b in beta.items()}
    assert CompactionConfig().bias_solver == "active_set"
    for solver in ("trf", "bvls"):
        assert abs(obj["active_set"] - obj[solver]) <= 1e-8 * obj[solver]
        assert float(np.abs(beta["active_set"] - beta[solver]).max()) < 0.05


def test_split_holds_out_context_rows_only():
    hkv, d = 2, 3
    ids = lambda lo, n: torch.arange(lo, lo + n, dtype=torch.float32)[None, :, None].expand(hkv, n, d)
    by_pass = {"context": (ids(0, 40),), "repeat": (ids(1000, 30),)}  # one layer; rows carry ids
    cap = Capture(keys=(torch.zeros(hkv, 5, d),), values=(torch.zeros(hkv, 5, d),),
                  queries=(ids(0, 1),), scales=(1.0,), counts={}, by_pass=by_pass, prefix_len=5,
                  seconds=0.0)
    split = split_queries(cap, 0.25, max_queries=1000, seed=0)
    near = set(split.near[0][0, :, 0].tolist())
    fit = set(split.fit[0][0, :, 0].tolist())
    assert len(near) == 10 and near <= set(range(40)) and not near & fit
    assert fit == (set(range(40)) - near) | set(range(1000, 1030))
    assert torch.equal(split.near[0][0], split.near[0][1])  # same rows for every head
    with pytest.raises(ValueError, match="heldout"):
        split_queries(cap, 1.0, max_queries=10, seed=0)


@pytest.mark.parametrize("field, value, needle", [
    ("tasks", ("nope",), "unknown task 'nope'"), ("methods", ("fold", "drop"), "must include 'am'"),
    ("methods", ("am", "fold", "evict"), "unknown method 'evict'"), ("ratios", (1.0,), "(0, 1)"),
    ("heldout", 0.0, "heldout=0.0"), ("lengths", (100,), "[256, 8192]"), ("samples", 0, "samples=0"),
    ("bias_solver", "lbfgs", "'lbfgs'"), ("ratios", (), "non-empty"),
])
def test_study_config_rejects_bad_values(field, value, needle):
    with pytest.raises(ValueError, match="StudyConfig") as err:
        StudyConfig(**{field: value})
    assert needle in str(err.value)


# ---------------------------------------------------------------- end to end on the bundled model

@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    from kvlocks_lab.compaction_study.run import run_study
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    cfg = StudyConfig(tasks=("qa_doc",), lengths=(320,), samples=1, ratios=(0.1,),
                      methods=("am", "fold", "drop"), max_queries=128, self_study_tokens=0,
                      far_tokens=16, max_new_tokens=4)
    out = tmp_path_factory.mktemp("study")
    summary = run_study(cfg, out, model=model, tok=tok, progress=False)
    return model, tok, cfg, out, summary


@pytest.mark.model
def test_tiny_study_schema_and_files(tiny_study):
    _, _, cfg, out, summary = tiny_study
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["rows"] == summary["rows"]
    for key in ("config", "commit", "versions", "rows", "aggregate", "targets"):
        assert key in on_disk
    schema = {"method", "ratio", "layer", "head", "err_near", "err_far", "kl", "accuracy", "compact_s"}
    assert all(schema <= set(r) for r in summary["rows"])
    heads = [r for r in summary["rows"] if r["kind"] == "head"]
    assert len(heads) == 3 * 30 * 3 and all(r["kl"] is None and r["accuracy"] is None for r in heads)
    tasks = {(r["method"], r["ratio"]) for r in summary["rows"] if r["kind"] == "task"}
    assert tasks == {("full", None)} | {(m, 0.1) for m in cfg.methods}
    full = next(r for r in summary["rows"] if r["method"] == "full")
    assert full["kl"] == 0.0 and full["accuracy"] in (0.0, 1.0)
    for name in ("report.md", "heads.jsonl", "records.jsonl", "fold_am_heatmap.png", "qu_hist.png"):
        assert (out / name).stat().st_size > 0
    agg = summary["aggregate"]
    assert agg["bound"]["0.1"]["near_exact"] == pytest.approx(1.0)  # a theorem: holds everywhere
    assert 0.0 < agg["qu_minus_1"]["near"]["mean_abs"] < 1.0
    assert summary["targets"]["file_roundtrip_gives_in_memory_tokens"] is True
    solvers = agg["bias_solvers"]["by_t"]  # trf and bvls on 7 layers' heads of the record
    assert solvers and all(abs(r["max_rel_obj"]) < 1e-6 for r in solvers)


@pytest.mark.model
def test_tiny_study_fold_errors_match_a_direct_recomputation(tiny_study):
    """Re-capture, compact with the per-method path and compute errors by explicit softmax."""
    from kvlocks.integrations.hf.compaction.capture import capture_queries
    from kvlocks.integrations.hf.compaction.passes import ReferenceConfig, reference_passes
    from kvlocks_lab.eval.tasks import generate

    model, tok, cfg, out, summary = tiny_study
    record = generate("qa_doc", tok, 320, 1, seed=0)[0]
    ctx = torch.tensor([record.context_ids])
    cap = capture_queries(model, ctx, reference_passes(tok, ctx, ReferenceConfig(self_study_tokens=0)),
                          max_queries=128, seed=0)
    split = split_queries(cap, cfg.heldout, 128, 0)
    rows = [json.loads(x) for x in (out / "heads.jsonl").read_text().splitlines()]
    got = {(r["method"], r["layer"], r["head"]): r for r in rows}
    ratios = []
    for layer in (0, 13, 29):
        k, v, s = cap.keys[layer].float(), cap.values[layer].float(), cap.scales[layer]
        errs = {}
        for m in ("am", "fold"):
            lay = compact_layer(k, v, split.fit[layer], None, cfg.compaction(m, 0.1), scale=s)
            for h in range(k.shape[0]):
                q = split.near[layer][h].double()
                full = torch.softmax(q @ k[h].double().T * s, -1) @ v[h].double()
                lg = q @ lay.keys[h].double().T * s
                if lay.beta is not None:
                    lg = lg + lay.beta[h].double()
                mine = torch.softmax(lg, -1) @ lay.values[h].double()
                err = float((mine - full).norm(dim=-1).mean() / full.norm(dim=-1).mean())
                errs[(m, h)] = err
                assert got[(m, layer, h)]["err_near"] == pytest.approx(err, rel=2e-4), (m, layer, h)
        ratios += [errs[("fold", h)] / errs[("am", h)] for h in range(k.shape[0])]
    # the summary's median ratio comes from the same per-head rows
    fold = [got[("fold", l, h)]["err_near"] / got[("am", l, h)]["err_near"] for l in range(30) for h in range(3)]
    assert summary["aggregate"]["ratio_vs_am"]["0.1"]["fold"]["near"] == pytest.approx(np.median(fold), rel=1e-4)
    assert all(r > 0 for r in ratios)
