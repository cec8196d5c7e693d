"""``kvlocks eval --records``: the schema's checks, the scorers, the split, and a run on the bundled model."""

import json

import pytest

from kvlocks_lab.eval.records import RecordError, check_record, contains, contains_all, exact, number, read_records

CHAT = {"messages": [{"role": "system", "content": "Answer with the number only."},
                     {"role": "user", "content": "Notes: the locker code is 5129. The hall is painted blue. "
                                                 "The garden has three oak trees. What is the locker code?"}],
        "question": "What is the locker code?", "answer_prefix": "The locker code is", "answers": ["5129"],
        "scorer": "number", "max_new_tokens": 4, "id": "locker"}
RAW = {"text": "Ann keeps a red kite. Tom keeps a green boat. " * 3 + "Question: what colour is Ann's kite? Answer:",
       "question": "Question:", "answers": ["red"], "max_new_tokens": 2}


def test_scorers():
    assert exact(" Paris.\nIt is the capital", ["paris"]) == 1 and exact("Paris is big", ["Paris"]) == 0
    assert contains("It is PARIS, of course", ["paris", "lyon"]) == 1 and contains("Rome", ["paris"]) == 0
    assert contains_all("red and blue", ["red", "blue", "green"]) == pytest.approx(2 / 3)
    assert number(" 1,024 apples and 3 pears", ["1024"]) == 1 and number("code 512 9", ["5129"]) == 0
    assert number("no digits here", ["1"]) == 0 and number("-2.50 degrees", ["-2.5"]) == 1


@pytest.mark.parametrize("change,message", [
    ({"answers": "5129"}, "field 'answers'"),
    ({"answers": []}, "field 'answers'"),
    ({"scorer": "fuzzy"}, "field 'scorer': unknown scorer"),
    ({"max_new_tokens": 0}, "field 'max_new_tokens'"),
    ({"question": "not in the prompt"}, "field 'question'"),
    ({"answer": ["x"]}, "unknown field(s) ['answer']"),
    ({"text": "both"}, "exactly one of 'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "last message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0: role"),
    ({"id": 1.5}, "field 'id'"),
    ({"meta": [1]}, "field 'meta'"),
])
def test_bad_records_name_record_and_field(change, message):
    with pytest.raises(RecordError, match="record 3 \\(line 5\\)") as exc:
        check_record({**CHAT, **change}, 3, 5, ("number", "contains"))
    assert message in str(exc.value)


def test_read_records_reports_file_line_and_duplicates(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(CHAT) + "\n\n" + "{not json\n")
    with pytest.raises(RecordError, match=r"r.jsonl: record 2 \(line 3\): not valid JSON"):
        read_records(path)
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    with pytest.raises(RecordError, match="field 'id': 'locker' repeats record 1"):
        read_records(path)
    path.write_text("\n")
    with pytest.raises(RecordError, match="holds no records"):
        read_records(path)


def test_cli_reports_bad_records_and_options_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import kvlocks.models
    from kvlocks.cli import main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the records were checked")

    monkeypatch.setattr(kvlocks.models, "load", refuse)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps({**RAW, "answers": [""]}) + "\n")
    out = tmp_path / "run"
    assert main(["eval", "--records", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "record 2 (line 2): field 'answers'" in err and "Traceback" not in err and not out.exists()
    assert main(["eval", "--records", str(path), "--tasks", "passkey", "--samples", "2", "--out", str(out)]) == 2
    assert "drop --tasks, --samples" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


@pytest.mark.model
def test_the_document_is_prefilled_and_the_question_decoded(model_tok):
    from kvlocks_lab.eval.records import prepare

    _, tok = model_tok
    chat = prepare(tok, check_record(CHAT, 1, 1, ("number",)), 0, 1, "mine")
    ctx, sfx = tok.decode(chat.context_ids), tok.decode(chat.suffix_ids)
    assert "Answer with the number only." in ctx and "locker code is 5129" in ctx and "What is" not in ctx
    assert sfx.lstrip().startswith("What is the locker code?") and sfx.endswith("assistant\nThe locker code is")
    assert chat.task == "mine" and chat.length == 256 and chat.row_fields["id"] == "locker"
    raw = prepare(tok, check_record(RAW, 2, 2, ("contains",)), 1, 2, "mine")
    assert tok.decode(raw.suffix_ids) == " Question: what colour is Ann's kite? Answer:"  # the space's token too
    assert "Question" not in tok.decode(raw.context_ids)
    plain = prepare(tok, check_record({k: v for k, v in CHAT.items() if k != "question"}, 1, 1, ("number",)), 0, 1, "t")
    assert tok.decode(plain.suffix_ids).startswith("<|im_end|>")  # only the turn's end onwards is decoded


@pytest.mark.model
def test_run_records_rows_resume_reuse_full_and_custom_scorer(model_tok, tmp_path, monkeypatch):
    import kvlocks_lab.eval.runner as runner
    from kvlocks_lab.eval.records_run import RecordsConfig, run_records

    model, tok = model_tok
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps({**RAW, "scorer": "starts_red"}) + "\n")
    starts_red = lambda prediction, answers: prediction.strip().lower().startswith(answers[0])
    out = tmp_path / "out"
    cfg = RecordsConfig(records=path, methods=("full", "locks"), budgets=(32, 1024))
    summary = run_records(cfg, out, scorers={"starts_red": starts_red}, model=model, tok=tok, progress=False)
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and summary["n_rows"] == 6 and {r["task"] for r in rows} == {"mine"}
    by = {(r["index"], r["method"], r["budget"]): r for r in rows}
    for i in (0, 1):  # budget >= context: the full answer exactly
        assert by[(i, "locks", 1024)]["tokens"] == by[(i, "full", None)]["tokens"]
        assert by[(i, "locks", 1024)]["kl"] < 1e-6
    assert by[(0, "full", None)]["scorer"] == "number" and by[(1, "full", None)]["scorer"] == "starts_red"
    assert by[(0, "full", None)]["id"] == "locker" and by[(1, "locks", 32)]["stats_read_fraction"] < 1
    for r in rows:
        assert r["score"] == (number if r["index"] == 0 else starts_red)(r["prediction"], r["references"])
    assert len(list((out / "reference").glob("*.pt"))) == 2
    for f in ("summary.json", "results.md", "score_vs_budget.png", "kl_vs_budget.png"):
        assert (out / f).exists()
    # a method added later: full's answers come from the saved references, not from decoding
    calls = []
    real = runner._answer
    monkeypatch.setattr(runner, "_answer", lambda *a, **k: calls.append(a[5] if len(a) > 5 else k.get("ref_tokens"))
                        or real(*a, **k))
    cfg2 = cfg.replace(methods=("full", "locks", "oracle"), budgets=(32,))
    run_records(cfg2, out, scorers={"starts_red": starts_red}, model=model, tok=tok, progress=False)
    assert len(calls) == 2 and all(c is not None for c in calls)  # one oracle run per record, none for full
    assert len((out / "rows.jsonl").read_text().splitlines()) == 8
    # the records changed under an existing run folder: refused
    path.write_text(json.dumps({**CHAT, "answers": ["9999"]}) + "\n")
    with pytest.raises(RecordError, match="record 1 made from other contents"):
        run_records(cfg, out, model=model, tok=tok, progress=False)
