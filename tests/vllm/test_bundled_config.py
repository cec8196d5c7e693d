"""vLLM picks a checkpoint's model class from its ``config.json``: a ``gemma3_text`` directory without
``architectures`` loads as an embedding model, so
every generate call fails. The conversion names the class, and older conversions gain it
(:func:`kvlocks.models.bundled._name_architecture`); this checks both against vLLM's own resolution."""

from __future__ import annotations

import json

from tiny_models import gemma3_like


def _resolved(model_dir):
    from vllm.config import ModelConfig

    m = ModelConfig(model=str(model_dir), max_model_len=1024, skip_tokenizer_init=True)
    return m.architectures, m.runner_type


def test_a_gemma3_text_directory_generates_once_it_names_its_class(tmp_path):
    from kvlocks.models.bundled import _name_architecture

    model_dir, _ = gemma3_like(tmp_path / "g", layers=6)
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    del config["architectures"]
    path.write_text(json.dumps(config))
    archs, runner = _resolved(model_dir)
    assert runner == "pooling"  # the failure mode: served as an embedding model
    _name_architecture("gemma3-270m", model_dir)
    assert _resolved(model_dir) == (["Gemma3ForCausalLM"], "generate")
