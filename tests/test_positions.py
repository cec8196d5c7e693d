"""The context-length policy (:mod:`kvlocks.positions`) at every entry point: the rule itself, the
engine, and the Hugging Face cache (a prompt past the model's positions is refused, or cut on the
side the caller names)."""

from __future__ import annotations

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
