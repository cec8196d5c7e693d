"""The retention run: carrier positions, the summary's arithmetic, and one small record end to end."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from kvlocks.integrations.hf.compaction.passes import ReferenceConfig, reference_passes
from kvlocks_lab.compaction_study import retention
from kvlocks_lab.compaction_study.retention_report import aggregate, write_summary


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


def test_carrier_positions_cover_exactly_the_answer_tokens(model_tok):
    _, tok = model_tok
    text = "The weather was mild. The special number is 7342. Nothing else happened"
    ids = tok(text, add_special_tokens=False).input_ids
    rec = SimpleNamespace(references=["7342"], context_text=text, context_ids=ids)
    pos = retention.carrier_positions(tok, rec)
    assert pos and tok.decode([ids[i] for i in pos]).strip() == "7342"
    assert retention.carrier_positions(tok, SimpleNamespace(references=["9999"], context_text=text,
                                                            context_ids=ids)) is None


def test_question_passes_are_fed_as_generate_feeds_a_prompt(model_tok):
    _, tok = model_tok
    ctx = torch.tensor([[1, 2, 3]])
    ref = ReferenceConfig(repeat=False, self_study=(), questions=("What is the key?",), self_study_tokens=5)
    (p,) = reference_passes(tok, ctx, ref)
    want = tok.apply_chat_template([{"role": "user", "content": "What is the key?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert p.name == "question_0" and p.generate == 5
    assert p.ids[0].tolist() == tok(want, add_special_tokens=False).input_ids
    base = copy.copy(tok)  # a base model (no chat template): the question exactly as generate feeds --prompt
    base.chat_template = None
    (p,) = reference_passes(base, ctx, ref)
    assert p.ids[0].tolist() == tok("What is the key?", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="questions"):
        ReferenceConfig(questions=("",))


def test_aggregate_means_and_paired_differences():
    rows = []
    for i, (full, fold) in enumerate([(1, 1), (1, 0), (0, 0), (1, 1)]):
        rows.append({"task": "a", "index": i, "method": "full", "accuracy": full})
        rows.append({"task": "a", "index": i, "method": "fold", "queries": "default", "ratio": 0.1,
                     "t": 10, "accuracy": fold, "kl": 0.5 * i, "top1": 1.0, "carriers_kept": None})
    s = aggregate(rows)
    assert s["full"] == {"a": {"n": 4, "accuracy": 0.75}}
    (cell,) = s["cells"]
    assert cell["n"] == 4 and cell["accuracy"] == 0.5 and cell["minus_full"] == -0.25
    assert cell["kl"] == statistics.fmean([0, 0.5, 1.0, 1.5]) and cell["carriers_kept"] is None
    lo, hi = cell["minus_full_ci95"]
    assert -1.0 <= lo <= -0.25 <= hi <= 0.0  # the paired differences are 0, -1, 0, 0


def test_one_record_end_to_end(model_tok, tmp_path):
    """rank1 reads AM's logits exactly: same KL and answer; the summary and plot are written."""
    model, tok = model_tok
    from kvlocks_lab.eval.tasks import generate

    record = generate("passkey", tok, 160, 1, seed=0)[0]
    args = argparse.Namespace(self_study_tokens=2, queries=["default", "question"], max_queries=128,
                              seed=0, methods=["am", "rank1", "fold"], query_methods=["fold"],
                              ratios=[0.5], selections=["guarded", "plain"])
    from kvlocks.compaction.prefix import model_info

    rows = retention.study_record(model, tok, record, args, model_info(model))
    by = {(r["queries"], r.get("selection"), r["method"]): r for r in rows}
    assert set(by) == {(None, None, "full")} | {(q, sel, m) for sel in ("guarded", "plain")
                                                 for q, m in [("default", "am"), ("default", "rank1"),
                                                              ("default", "fold"), ("question", "fold")]}
    for sel in ("guarded", "plain"):
        am, r1 = by[("default", sel, "am")], by[("default", sel, "rank1")]
        assert r1["kl"] == pytest.approx(am["kl"], rel=1e-4, abs=1e-6)
        assert r1["prediction"] == am["prediction"]
    assert all(r["t"] == round(0.5 * r["T"]) for r in rows if r["method"] != "full")
    assert all(0.0 <= r["carriers_kept"] <= 1.0 for r in rows)
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = write_summary(tmp_path)
    assert (tmp_path / "retention.png").stat().st_size > 0 and len(summary["cells"]) == 8


def test_selection_entries():
    assert retention.selection_fields("plain") == {"coverage_share": 0.0, "value_anchor": 0.0}
    assert retention.selection_fields("guarded") == {}
    assert retention.selection_fields("0.5:0.01") == {"coverage_share": 0.5, "value_anchor": 0.01}
    with pytest.raises(ValueError, match="COVERAGE:ANCHOR"):
        retention.selection_fields("0.5")
