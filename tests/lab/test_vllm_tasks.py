"""kvlocks_lab.eval.vllm_tasks without vLLM: the records and rows it writes, its refusals."""

from __future__ import annotations

import pytest

from kvlocks_lab.eval.vllm_tasks import build_records, first_difference, main, rows_of


def test_first_difference_by_hand():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert first_difference([], []) is None


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
                                         (["--tasks", "ppl_continuation"], "allowed")])
def test_bad_arguments_are_refused_with_the_rule(tmp_path, capsys, args, needle):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--model", "smollm2-135m", *args])
    assert needle in capsys.readouterr().err
