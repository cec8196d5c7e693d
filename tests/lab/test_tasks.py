"""Task generators (determinism, answer in prompt, length <= L, depth) and task scoring."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from kvlocks_lab.eval.tasks import (
    TASKS,
    TaskRecord,
    TaskSpec,
    answer_spans,
    generate,
    score,
    string_match_all,
    string_match_part,
    string_match_strict,
)
from kvlocks_lab.eval.tasks.build import fit, record_depth, weave
from kvlocks_lab.eval.tasks.extraction import zipf_counts
from kvlocks_lab.eval.tasks.needles import passkey

LENGTHS = (512, 2048)
N = 2
NO_DEPTH = {"cwe", "fwe"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvlocks.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"), local_files_only=True)


@pytest.fixture(scope="module")
def made(tok):
    cache = {}

    def get(task, length, seed=0):
        if (task, length, seed) not in cache:
            cache[task, length, seed] = generate(task, tok, length, N, seed)
        return cache[task, length, seed]

    return get


GRID = [(t, L) for t in TASKS for L in LENGTHS]


@pytest.mark.parametrize("task,length", GRID)
def test_fits_length_under_real_tokenizer(tok, made, task, length):
    for r in made(task, length):
        assert r.prompt_tokens + r.max_new_tokens <= length
        assert r.prompt_tokens + r.max_new_tokens >= 0.75 * length  # the haystack was filled
        joint = tok(r.context_text + r.suffix_text, add_special_tokens=False).input_ids
        assert joint == r.context_ids + r.suffix_ids  # exactly the dense prompt's tokens
        assert r.length == length and r.task == task and r.max_new_tokens == TASKS[task].max_new_tokens


@pytest.mark.parametrize("task,length", GRID)
def test_answer_is_in_context_not_in_suffix(tok, made, task, length):
    for r in made(task, length):
        context = tok.decode(r.context_ids)
        assert r.references and all(ref in context for ref in r.references)
        assert not any(ref in r.suffix_text for ref in r.references)


@pytest.mark.parametrize("task,length", GRID)
def test_split_is_question_then_assistant_header_then_prefix(made, task, length):
    for r in made(task, length):
        assert "<|im_start|>assistant\n" in r.suffix_text
        assert "<|im_start|>assistant" not in r.context_text
        assert r.context_text.startswith("<|im_start|>system") and r.context_text.endswith("\n")
        assert r.suffix_text.split("<|im_start|>assistant\n")[1].strip()  # an answer prefix follows


@pytest.mark.parametrize("task,length", GRID)
def test_deterministic_and_seed_dependent(tok, made, task, length):
    first = made(task, length)
    assert generate(task, tok, length, N, 0) == first
    other = made(task, length, seed=1)
    assert all(a.context_ids != b.context_ids for a, b in zip(first, other))
    assert first[0].context_ids != first[1].context_ids


@pytest.mark.parametrize("task,length", GRID)
def test_depth_recorded(made, task, length):
    for r in made(task, length):
        if task in NO_DEPTH:
            assert r.depth is None and r.needle_depths == []
        else:
            assert 0.0 <= r.depth <= 1.0 and r.depth == r.needle_depths[0]
            assert all(0.0 <= d <= 1.0 for d in r.needle_depths)


@pytest.mark.parametrize("task", list(TASKS))
def test_references_score_full_marks(made, task):
    r = made(task, 512)[0]
    assert (r.metric, r.shape) == (TASKS[task].metric, TASKS[task].shape)
    s = score(r, " " + ", ".join(r.references) + ".")
    assert s == {"match_all": 1.0, "match_part": 1.0, "strict": 1.0, "score": 1.0}
    assert score(r, "I do not know.")["score"] == 0.0


def test_same_needles_at_every_length(made):
    a, b = made("niah_single_text", 512)[0], made("niah_single_text", 2048)[0]
    assert a.references == b.references and abs(a.depth - b.depth) < 0.1


def test_identical_across_processes(made):
    code = ("import hashlib,json;from transformers import AutoTokenizer;"
            "from kvlocks.models import resolve;from kvlocks_lab.eval.tasks import generate;"
            "tok=AutoTokenizer.from_pretrained(resolve('smollm2-135m'),local_files_only=True);"
            "print(json.dumps({t:hashlib.sha256(str([r.to_dict() for r in generate(t,tok,512,2,0)])"
            ".encode()).hexdigest() for t in ('kv_uuid','qa_doc','cwe','vt_4hop')}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = {t: hashlib.sha256(str([r.to_dict() for r in made(t, 512)]).encode()).hexdigest() for t in theirs}
    assert theirs == ours


def test_record_roundtrips_through_json(made):
    r = made("niah_multikey", 512)[0]
    assert TaskRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert r.key == ("niah_multikey", 512, 0, 0)


def test_generate_validates(tok):
    with pytest.raises(ValueError, match="task='nope'"):
        generate("nope", tok, 512, 1)
    with pytest.raises(ValueError, match="n=-1"):
        generate("passkey", tok, 512, -1)
    with pytest.raises(ValueError, match="length=100 is too small"):
        generate("kv_uuid", tok, 100, 1)
    assert generate("passkey", tok, 512, 0) == []


def test_taskspec_validates():
    with pytest.raises(ValueError, match="metric='any'"):
        TaskSpec(name="x", draft=passkey, metric="any", shape="number", max_new_tokens=8)
    with pytest.raises(ValueError, match="shape='digits'"):
        TaskSpec(name="x", draft=passkey, metric="all", shape="digits", max_new_tokens=8)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        TaskSpec(name="x", draft=passkey, metric="all", shape="number", max_new_tokens=0)


def test_weave_places_needles_by_depth():
    units = ["aa ", "bb ", "cc ", "dd "]  # 12 filler characters
    pieces, depths = weave(units, [(0.5, "X "), (0.0, "Y "), (1.0, "Z ")])
    assert pieces == ["Y ", "aa ", "bb ", "X ", "cc ", "dd ", "Z "]
    assert depths == (0.5, 0.0, 1.0)
    _, d = weave(["a ", "bbbbbb "], [(0.5, "N ")])  # round(0.5 * 2) = 1 unit before: 2 of 9 chars
    assert d == (2 / 9,)


def test_fit_finds_largest_fitting_count():
    calls = []

    def count(n):
        calls.append(n)
        return 10 + 3 * n

    assert fit(count, 100, 1) == 30 and len(calls) < 12
    assert fit(lambda n: 10 + 3 * n, 13, 1) == 1
    with pytest.raises(ValueError):
        fit(lambda n: 10 + 3 * n, 12, 1)


def test_depth_sequence_is_spread():
    depths = sorted(record_depth("t", 0, i) for i in range(20))
    assert all(0 <= d < 1 for d in depths) and max(b - a for a, b in zip(depths, depths[1:])) < 0.1


def test_zipf_counts_separate_the_top_three():
    for total in range(80, 3000, 37):
        c = zipf_counts(total, 64, 2.0)
        assert sum(c) == total and c == sorted(c, reverse=True) and c[2] > c[3]


# ---- scoring on hand-computed cases ----

def test_string_match_all_and_part():
    refs = ["123", "456", "789"]
    assert string_match_all("The numbers are 123 and 456.", refs) == pytest.approx(2 / 3)
    assert string_match_part("The numbers are 123 and 456.", refs) == 1.0
    assert string_match_part("none here", refs) == 0.0
    assert string_match_all("GRANITE and Arrow", ["granite", "arrow"]) == 1.0  # case-insensitive
    with pytest.raises(ValueError):
        string_match_all("x", [])
    with pytest.raises(ValueError):
        string_match_all("x", "123")


def test_string_match_strict():
    assert string_match_strict(" 12 rooms", ["12"], "number") == 1.0
    assert string_match_part(" 112 rooms", ["12"]) == 1.0
    assert string_match_strict(" 112 rooms, or 12", ["12"], "number") == 0.0  # first span is 112
    # m = 2 references: judged on the first two spans only
    assert string_match_strict("1. ochre 2. amber 3. scarlet", ["amber", "scarlet"], "word") == 0.5
    assert string_match_strict("QWERT, asdfg and ZXCVB", ["QWERT", "ZXCVB"], "varname") == 1.0
    u = "052392a8-2313-4ba6-986d-b02ed578fc5c"
    assert string_match_strict(f'"{u.upper()}"', [u], "uuid") == 1.0
    assert answer_spans("pier 7, not 12", "token") == ["pier", "7", "not", "12"]
    with pytest.raises(ValueError, match="shape='date'"):
        answer_spans("x", "date")


def test_score_uses_declared_metric():
    rec = {"references": ["a1", "b2"], "metric": "part", "shape": "token"}
    assert score(rec, "a1 only") == {"match_all": 0.5, "match_part": 1.0, "strict": 0.5, "score": 1.0}
    rec["metric"] = "all"
    assert score(rec, "a1 only")["score"] == 0.5
