"""The context-length policy (:mod:`kvlocks.positions`) at every entry point: the rule itself, the
engine, and the Hugging Face cache (a prompt past the model's positions is refused, or cut on the
side the caller names)."""

from __future__ import annotations

import json

import pytest
import torch

from kvlocks.positions import check_context, position_limit


def test_rule_keeps_fitting_prompts_refuses_or_cuts_the_named_side():
    assert check_context(100, 28, 128) == slice(0, 100)
    assert check_context(100, 28, None) == slice(0, 100)
    with pytest.raises(ValueError, match=r"prompt \(101 tokens\) plus 28 new tokens exceeds the model's 128 "
                                         r"positions .*truncate='left'.* to 100 tokens"):
        check_context(101, 28, 128)
    assert check_context(150, 28, 128, truncate="left") == slice(50, 150)  # keeps the end
    assert check_context(150, 28, 128, truncate="right") == slice(0, 100)  # keeps the start
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        check_context(10, 128, 128, truncate="left")  # not one prompt token would fit
    with pytest.raises(ValueError, match="truncate='middle': allowed"):
        check_context(10, 1, 128, truncate="middle")
    with pytest.raises(ValueError, match="empty"):
        check_context(0, 1, 128)


def _tiny(positions=96):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlocks.integrations.hf import enable

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=positions)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    enable(model)
    return model


def test_position_limit_reads_the_text_config():
    model = _tiny(96)
    assert position_limit(model.config) == 96
    assert position_limit(object()) is None


def test_hf_cache_refuses_a_context_past_the_positions():
    from kvlocks.config import LocksConfig
    from kvlocks.integrations.hf import LocksCache, cache_kwargs

    model = _tiny(96)
    ids = torch.randint(0, 128, (1, 90))
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=32))
    out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **cache_kwargs(model, cache))
    assert out.shape[1] == 96  # exactly the 96 positions
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=32))
    with pytest.raises(ValueError, match=r"context \(97 tokens\) exceeds the model's 96 positions"):
        model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **cache_kwargs(model, cache))
    cache = LocksCache(model.config, method="full")
    with pytest.raises(ValueError, match=r"context \(100 tokens\) exceeds"):
        model(input_ids=torch.randint(0, 128, (1, 100)), **cache_kwargs(model, cache))


def test_engine_refuses_a_prompt_past_the_positions():
    from kvlocks.engine import DecodeEngine, EngineConfig

    model = _tiny(96)
    eng = DecodeEngine(model, EngineConfig(method="dense", batch=1, max_context=256, cuda_graph=False,
                                           backend="torch"))
    with pytest.raises(ValueError, match=r"prompt \(90 tokens\) plus 8 new tokens exceeds the model's 96"):
        eng.generate(torch.randint(0, 128, (1, 90)), max_new_tokens=8)
    assert eng.generate(torch.randint(0, 128, (1, 90)), max_new_tokens=6).shape == (1, 6)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 128-position llama with the bundled model's tokenizer, saved as a local model directory."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvlocks.models import resolve

    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny128")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


TEXT = " ".join(f"Item {i} is {i * 7 % 13}." for i in range(60)) + " Question: what is item 3? Answer:"


def test_fit_prompt_cuts_the_named_side_of_the_text_and_keeps_the_framing(tiny_dir):
    from kvlocks.commands.fit import fit_prompt

    _, tok = tiny_dir
    n = lambda s: len(tok(s, add_special_tokens=False).input_ids)  # noqa: E731
    render = lambda text: "<<" + text + ">> Answer prefix:"  # noqa: E731
    assert n(render(TEXT)) > 200
    with pytest.raises(ValueError, match=r"exceeds the model's 128 positions.*--truncate left"):
        fit_prompt(tok, TEXT, render, 8, 128, None)
    for side in ("left", "right"):
        fitted, dropped = fit_prompt(tok, TEXT, render, 8, 128, side)
        assert fitted.startswith("<<") and fitted.endswith(">> Answer prefix:")
        body = fitted[2:-len(">> Answer prefix:")]
        assert (TEXT.endswith(body) if side == "left" else TEXT.startswith(body)) and len(body) < len(TEXT)
        assert 120 - 8 <= n(fitted) + 8 <= 128 and dropped > 0  # fills the positions, within a few tokens
    short = "Item 1 is 7."
    assert fit_prompt(tok, short, render, 8, 128, "left") == (render(short), 0)
    with pytest.raises(ValueError, match="leaves no room"):
        fit_prompt(tok, short, render, 8, 100, "left", offset=100)  # a compacted prefix took every position


def test_generate_refuses_or_truncates_on_request(tiny_dir, capsys):
    from kvlocks.cli import main

    path, tok = tiny_dir
    base = ["generate", "--model", str(path), "--raw", "--prompt", TEXT, "--max-new-tokens", "4", "--json"]
    assert main(base) == 2
    assert "exceeds the model's 128 positions" in capsys.readouterr().err
    for side in ("left", "right"):
        assert main(base + ["--truncate", side, "--method", "full"]) == 0
        cap = capsys.readouterr()
        out = json.loads(cap.out)
        assert out["prompt_tokens"] + 4 <= 128 and out["prompt_tokens"] > 100
        assert f"--truncate {side}: dropped" in cap.err


def test_compaction_refuses_a_prefix_whose_passes_run_past_the_positions():
    from kvlocks.integrations.hf.compaction.capture import capture_queries
    from kvlocks.integrations.hf.compaction.passes import QueryPass

    model = _tiny(96)
    ids = torch.randint(0, 128, (1, 80))
    with pytest.raises(ValueError, match=r"prefix to compact \(100 tokens\)"):
        capture_queries(model, torch.randint(0, 128, (1, 100)), [], max_queries=8, seed=0)
    late = QueryPass("self-study", torch.randint(0, 128, (1, 10)), generate=8)  # ends at position 98
    with pytest.raises(ValueError, match=r"'self-study' reference pass reaches position 98, past the model's 96"):
        capture_queries(model, ids, [late], max_queries=8, seed=0)
    fits = QueryPass("self-study", torch.randint(0, 128, (1, 10)), generate=6)
    cap = capture_queries(model, ids, [fits], max_queries=8, seed=0)
    assert cap.prefix_len == 80


def test_repeat_spans_past_the_positions_run_at_the_last_positions_that_fit():
    from kvlocks.integrations.hf.compaction.capture import _fit_positions
    from kvlocks.integrations.hf.compaction.passes import repeat_pass

    model = _tiny(96)
    head, prefix = torch.randint(0, 128, (1, 3)), torch.randint(0, 128, (1, 60))
    p = repeat_pass(head, prefix, tokens=20, span=10)  # 2 spans, at 60 + 0 and 60 + 50 in the whole repeat
    assert p.segments == ((13, 60), (13, 110))
    (fitted,) = _fit_positions(model, 60, [p])
    assert fitted.segments == ((13, 60), (13, 83))  # the second ends at position 96, the last that fits
    with pytest.raises(ValueError, match="'repeat' reference pass reaches position 103"):
        _fit_positions(model, 90, [repeat_pass(head, torch.randint(0, 128, (1, 90)), tokens=20, span=10)])
