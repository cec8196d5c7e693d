"""kvlocks_lab.eval.vllm_tasks without vLLM: the records and rows it writes, its refusals."""

from __future__ import annotations

import pytest

from types import SimpleNamespace

from kvlocks_lab.eval.vllm_tasks import build_records, exact_report, main, rows_of


def test_exact_report_counts_tie_flips_and_wrong_tokens_by_hand():
    recs = [SimpleNamespace(task="passkey", length=8192, index=i) for i in range(4)]
    tie = [{"1": -0.70, "2": -0.72}]  # 1 and 2 each other's runner-up, 0.02 nats apart
    far = [{"1": -0.1, "2": -3.0}]
    ref = {"tokens": [[5, 1], [5, 1], [5, 1], [5, 1]], "top": [None, [{}] + tie, [{}] + far, None]}
    got = {"tokens": [[5, 1], [5, 2], [5, 2], [5]],
           "top": [None, [{}, {"2": -0.71, "1": -0.71}], [{}, {"2": -0.5, "1": -2.0}], None]}
    rep = exact_report(recs, got, ref, budget=40000)
    assert (rep["records"], rep["differing"], rep["tie_flips"], rep["wrong"]) == (4, 3, 1, 2)
    by_index = {d["index"]: d for d in rep["differences"]}
    assert by_index[1]["verdict"] == "tie" and by_index[1]["first_difference"] == 1
    assert by_index[1]["reference_margin"] == pytest.approx(0.02)
    assert by_index[2]["verdict"] == "wrong"  # the reference preferred its token by 2.9 nats
    assert by_index[3]["verdict"] == "wrong" and by_index[3]["first_difference"] == 1  # stopped early
    assert exact_report(recs, got, None, budget=1)["error"]


def test_rows_score_the_suite_records_like_the_eval():
    from kvlocks.models import resolve

    records, eos, tok = build_records(str(resolve("smollm2-135m")), ["passkey"], [1024], 2, 0)
    assert [(r.task, r.length, r.index) for r in records] == [("passkey", 1024, 0), ("passkey", 1024, 1)]
    assert tok.eos_token_id in eos
    right = tok.encode(" " + records[0].references[0] + ".", add_special_tokens=False)
    wrong = tok.encode(" 0.", add_special_tokens=False)
    rows = rows_of(records, [right, wrong], "vllm_locks", 256, tok, eos, ref=[right, right], commit="c")
    assert [r["score"] for r in rows] == [1.0, 0.0]
    assert [r["exact_agree"] for r in rows] == [1.0, 0.0]
    assert rows[0]["prompt_tokens"] == len(records[0].context_ids) + len(records[0].suffix_ids)
    assert {r["method"] for r in rows} == {"vllm_locks"} and all(r["kl"] is None and r["budget"] == 256 for r in rows)


@pytest.mark.parametrize("args,needle", [(["--budgets", "16"], ">= 32 tokens"), (["--samples", "0"], ">= 1"),
                                         (["--tasks", "ppl_continuation"], "allowed"),
                                         (["--gpu-memory-utilization", "1.5"], "(0, 1]")])
def test_bad_arguments_are_refused_with_the_rule(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--model", "smollm2-135m", *args])
    assert needle in capsys.readouterr().err
