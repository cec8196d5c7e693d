"""Perplexity of natural-text continuations: records, the runner against a direct forward, report."""

from __future__ import annotations

import math

import pytest
import torch

from kvlocks_lab.eval.continuation import PPL_TASK, continuation_record, generate_continuations
from kvlocks_lab.eval.report import markdown, summarize_ppl
from kvlocks_lab.eval.suite import EvalConfig


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvlocks.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"), local_files_only=True)


def test_records_are_consecutive_text_deterministic_and_length_exact(tok):
    recs = generate_continuations(tok, 512, 3, 64, seed=0)
    for r in recs:
        assert r.task == PPL_TASK and len(r.context_ids) == 448 and len(r.target_ids) == 64
        assert r.prefill_ids == r.context_ids[:-1] and len(r.feed_ids) == 64
        assert r.feed_ids == r.context_ids[-1:] + r.target_ids[:-1]  # step i predicts target i
    assert len({r.start for r in recs}) == 3  # different windows
    assert continuation_record(tok, 512, 64, 1, seed=0) == recs[1]  # a pure function of its inputs
    assert continuation_record(tok, 512, 64, 1, seed=1).start != recs[1].start
    longer = continuation_record(tok, 1024, 64, 1, seed=0)
    assert longer.start == recs[1].start and longer.context_ids[:448] == recs[1].context_ids  # same text, longer
    text = tok.decode(recs[0].context_ids + recs[0].target_ids)
    assert len(text.split()) > 200 and "\ufffd" not in text  # natural prose


@pytest.mark.parametrize("kwargs,needle", [
    ({"length": 512, "new_tokens": 0}, "new_tokens"),
    ({"length": 512, "new_tokens": 500}, "context"),
    ({"length": 10, "new_tokens": 1}, "length"),
])
def test_record_arguments_are_validated(tok, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        continuation_record(tok, index=0, **kwargs)


def test_eval_config_knows_the_task_and_bounds_ppl_tokens():
    assert PPL_TASK in EvalConfig().tasks
    with pytest.raises(ValueError, match="ppl_tokens"):
        EvalConfig(lengths=(512, 2048), ppl_tokens=257)
    with pytest.raises(ValueError, match="ppl_continuation"):
        EvalConfig(tasks=("nonexistent",))


def _row(method, budget, index, nll, **kw):
    return {"task": PPL_TASK, "length": 512, "index": index, "method": method, "budget": budget, "nll": nll,
            "ppl": math.exp(nll), "kl": 0.0, "top1": 1.0, "new_tokens": 8, **kw}


def test_summary_perplexity_cells_hand_computed():
    rows = [_row("full", None, 0, 1.0), _row("full", None, 1, 2.0),
            _row("locks", 64, 0, 1.5), _row("locks", 64, 1, 2.5),
            _row("fold@0.1", None, 0, 1.1, ratio=0.1, kept=40, compact_s=3.0),
            _row("fold@0.1", None, 1, 2.1, ratio=0.1, kept=44, compact_s=5.0)]
    cells = {(c["method"], c["budget"]): c for c in summarize_ppl(rows)}
    lk = cells[("locks", 64)]
    assert lk["n"] == 2 and lk["nll"] == pytest.approx(2.0)
    assert lk["ppl"] == pytest.approx((math.exp(1.5) + math.exp(2.5)) / 2)
    assert lk["nll_diff_vs_full"]["mean"] == pytest.approx(0.5)
    assert lk["nll_diff_vs_full"]["low"] == pytest.approx(0.5) == lk["nll_diff_vs_full"]["high"]
    want = ((math.exp(1.5) - math.e) + (math.exp(2.5) - math.exp(2.0))) / 2
    assert lk["ppl_diff_vs_full"]["mean"] == pytest.approx(want)
    assert lk["ppl_ratio_vs_full"] == pytest.approx(math.exp(0.5))
    assert lk["ppl_diff_vs_oracle"] is None  # no oracle rows
    fold = cells[("fold@0.1", None)]
    assert fold["kept"] == 42 and fold["ratio"] == 0.1 and fold["ppl_ratio_vs_full"] == pytest.approx(math.exp(0.1))
    assert cells[("full", None)]["ppl_diff_vs_full"] is None and cells[("full", None)]["ppl_ratio_vs_full"] == 1.0
    md = markdown([], [], list(cells.values()))
    assert "| 512 | fold@0.1 | kept 42 | 2 |" in md and "| 512 | locks | 64 | 2 |" in md


@pytest.mark.model
def test_full_ppl_equals_one_forward_and_big_budget_locks_equals_full():
    from kvlocks_lab.eval.ppl import run_continuation
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    record = continuation_record(tok, 320, 24, 0, seed=0)
    rows = []
    with torch.inference_mode():
        run_continuation(model, tok, record, ("full", "locks"), (32, 512), EvalConfig().locks_config(32), {},
                         rows.append)
        # independent: one dense forward over all L tokens, no cache, logits of positions P-1 .. L-2
        ids = torch.tensor([record.context_ids + record.target_ids])
        logits = model(input_ids=ids).logits[0].float()  # [L, V]
        p = len(record.context_ids)
        lp = torch.log_softmax(logits[p - 1 : -1], dim=-1)  # [N, V]
        nll = -lp.gather(-1, torch.tensor(record.target_ids)[:, None]).mean().item()
    by = {(r["method"], r["budget"]): r for r in rows}
    full, big, small = by[("full", None)], by[("locks", 512)], by[("locks", 32)]
    assert full["nll"] == pytest.approx(nll, abs=1e-4) and full["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert full["kl"] == 0.0 and full["new_tokens"] == 24 and full["prompt_tokens"] == 296
    # budget >= context: LOCKS attends every page, same perplexity
    assert big["ppl"] == pytest.approx(full["ppl"], rel=1e-5) and big["kl"] < 1e-6 and big["top1"] == 1.0
    # two pages per step: the method is really active during the continuation
    assert small["kl"] > 1e-3 and small["stats_read_fraction"] < big["stats_read_fraction"]
    assert small["stats_decode_steps"] == 24
