"""`kvlocks compact`: --question joins the reference queries; the lines printed before a long input."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors import safe_open

from kvlocks.compaction.config import CompactionConfig
from kvlocks.compaction.estimate import DEFAULT_RATIO, QUESTION_RETENTION, RETENTION, estimate_seconds, tradeoff_lines
from kvlocks.integrations.hf.compaction.passes import ReferenceConfig
from kvlocks.corpus import natural_units

pytestmark = pytest.mark.model


def test_question_is_recorded_in_the_cache_file(tmp_path):
    from kvlocks.cli import main

    text = tmp_path / "doc.txt"
    text.write_text("".join(natural_units()[:12]))
    out = tmp_path / "cache.safetensors"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["compact", "--input", str(text), "--out", str(out), "--max-tokens", "64",
                   "--max-queries", "128", "--self-study-tokens", "1", "--no-repeat",
                   "--question", "What is the text about?", "--answer-prefix", "It is about", "--json"])
    assert rc == 0, buf.getvalue()
    report = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert report["config"]["ratio"] == DEFAULT_RATIO and report["t"] == round(DEFAULT_RATIO * 64)
    with safe_open(str(out), framework="pt") as f:
        ref = json.loads(f.metadata()["reference_config"])
    assert ref["questions"] == ["What is the text about?"] and ref["answer_prefix"] == "It is about"


def test_answer_prefix_follows_each_question_as_generate_appends_it():
    import copy

    from kvlocks.chat import next_user_turn
    from kvlocks.integrations.hf.compaction.passes import reference_passes
    from kvlocks.models import load

    _, tok = load("smollm2-135m")
    ctx = torch.tensor([[1, 2, 3]])
    ref = ReferenceConfig(repeat=False, self_study=(), questions=("What is the key?",), answer_prefix="The key is",
                          chat=True, self_study_tokens=4)
    (p,) = reference_passes(tok, ctx, ref)  # generate --cache after a chat prefix: the next turn, then the prefix
    want = next_user_turn(tok, "What is the key?") + "The key is"
    assert p.ids[0].tolist() == tok(want, add_special_tokens=False).input_ids
    base = copy.copy(tok)  # a base model: the question and the prefix as they are
    base.chat_template = None
    (p,) = reference_passes(base, ctx, ref)
    assert p.ids[0].tolist() == tok("What is the key?The key is", add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="answer_prefix follows each question"):
        ReferenceConfig(answer_prefix="The key is")


def test_lines_before_a_long_input_state_time_and_tradeoff():
    from kvlocks.commands.compact import _before_start

    lines = _before_start(4096, CompactionConfig(ratio=0.1), ReferenceConfig(), model="smollm2-135m", layer_heads=90,
                           pass_scale=1.0)
    assert lines[0].startswith("keeping 410 of 4096 entries") and "estimated time about" in lines[0]
    kept, n = RETENTION["smollm2-135m"][0.1]
    assert f"{kept} of {n} answers kept" in lines[1] and "(smollm2-135m," in lines[1] and "--question" in lines[2]
    assert "ratio 0.25" in tradeoff_lines(0.3, True)[1] and "0.25" in tradeoff_lines(0.3, True)[0]
    assert "{} of {} answers kept".format(*QUESTION_RETENTION["smollm2-135m"][0.25]) in tradeoff_lines(0.3, True)[1]


def test_tradeoff_is_the_model_own_and_says_so_for_other_models():
    g = tradeoff_lines(0.1, True, "gemma3-270m")
    assert "(gemma3-270m," in g[0] and "{} of {}".format(*RETENTION["gemma3-270m"][0.1]) in g[0]
    assert "ratio 0.1: {} of {}".format(*QUESTION_RETENTION["gemma3-270m"][0.1]) in g[1]
    other = tradeoff_lines(0.25, False, "/models/my-llama")
    assert "(smollm2-135m, not this model," in other[0]


def test_estimate_scales_the_fits_with_the_fitted_layer_heads():
    # Gemma 3 270M fits its 3 global layers' one KV head; the bundled model 30 layers x 3 heads
    few, many = estimate_seconds(4096, 410, layer_heads=3), estimate_seconds(4096, 410, layer_heads=90)
    fits_90 = many - estimate_seconds(4096, 410, layer_heads=0)
    assert few == pytest.approx(many - fits_90 * 87 / 90)
    passes = estimate_seconds(4096, 410, layer_heads=0)
    assert estimate_seconds(4096, 410, layer_heads=0, pass_scale=0.5) == pytest.approx(passes / 2)


def test_estimate_grows_with_the_prefix_and_the_budget():
    a, b = estimate_seconds(2048, 205), estimate_seconds(4096, 410)
    assert 0 < a < b and estimate_seconds(4096, 1024) > b
    # the repeat spans cap the repeat pass: doubling T past repeat_tokens adds no repeat tokens
    short = estimate_seconds(8192, 819, repeat_tokens=1536) - estimate_seconds(8192, 819, repeat_tokens=8192)
    assert short < 0
