"""The connector's pure parts, against independent references (no engine; run in the vLLM venv)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvlocks.integrations.vllm import compat
from kvlocks.integrations.vllm.connector.compacted import FileHeader, placeholder_ids, read_header, resolve_path
from kvlocks.integrations.vllm.connector.rope import RopeShiftError, key_shifter

LLAMA = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=4096)
ROPES = [
    {"rope_type": "default", "rope_theta": 1e5},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 1024},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shift_equals_rotating_at_the_shifted_position(family, rope):
    """shift(R(p) k, s) == R(p - s) k, with R from transformers' own rotary module of the family
    (yarn's attention factor included), for positions that go negative too."""
    import importlib

    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, **LLAMA, rope_parameters=rope)
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = getattr(mod, f"{'Llama' if family == 'llama' else 'Qwen3'}RotaryEmbedding")(cfg)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(3, 40, 64, generator=gen)
    p = torch.randint(0, 900, (3, 40), generator=gen)

    def at(pos):
        cos, sin = rotary(torch.zeros(1), pos)  # [3, 40, 64] each, attention factor included
        return k * cos + mod.rotate_half(k) * sin

    shifted = key_shifter(cfg).shift(at(p), 317)
    # float32 angles of transformers' cos/sin at positions < 1000 are good to ~1e-4 rad
    torch.testing.assert_close(shifted.float(), at(p - 317), rtol=0, atol=3e-4)
    assert key_shifter(cfg).shift(at(p), 0).float().equal(at(p))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
                                  {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 32,
                                   "long_factor": [2.0] * 32, "original_max_position_embeddings": 1024}],
                         ids=lambda r: r["rope_type"])
def test_sequence_length_dependent_rope_is_refused(rope):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", **LLAMA, rope_parameters=rope)
    with pytest.raises(RopeShiftError, match=rope["rope_type"]):
        key_shifter(cfg)


def test_unknown_family_is_refused():
    cfg = SimpleNamespace(model_type="gptj", rope_parameters={"rope_type": "default"})
    with pytest.raises(RopeShiftError, match="gptj"):
        key_shifter(cfg)


def _header(checksum: str, t: int) -> FileHeader:
    return FileHeader(path=None, checksum=checksum, prefix_len=2 * t, kept=t, method="fold", round_dtype="",
                      model=None)


def test_placeholder_ids_name_the_file():
    a = placeholder_ids(_header("sha256:aa", 300), 49152)
    assert a == placeholder_ids(_header("sha256:aa", 300), 49152)  # deterministic
    assert len(a) == 300 and all(0 <= i < 49152 for i in a) and len(set(a)) > 290
    b = placeholder_ids(_header("sha256:ab", 300), 49152)
    assert sum(x == y for x, y in zip(a, b)) < 5  # another file: other ids from the first token on
    assert a[:100] == placeholder_ids(_header("sha256:aa", 100), 49152)


def test_resolve_path(tmp_path):
    assert resolve_path("x.safetensors", str(tmp_path)) == tmp_path / "x.safetensors"
    assert resolve_path("sub/x.safetensors", str(tmp_path)) == tmp_path / "sub" / "x.safetensors"
    for name in ("../x.safetensors", "/etc/passwd", "sub/../../x"):
        with pytest.raises(ValueError, match="outside"):
            resolve_path(name, str(tmp_path))
    with pytest.raises(ValueError, match="absolute"):
        resolve_path("x.safetensors", None)
    assert resolve_path("/a/x.safetensors", None) == type(tmp_path)("/a/x.safetensors")
    for bad in ("", None, 3):
        with pytest.raises(ValueError):
            resolve_path(bad, str(tmp_path))


def test_read_header_refuses_other_files(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        read_header(tmp_path / "junk.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="kvlocks-compacted-cache"):
        read_header(tmp_path / "other.safetensors")


def test_local_kv_heads_follow_vllm_split():
    assert [compat.local_kv_heads(3, r, 1) for r in range(1)] == [[0, 1, 2]]
    assert [compat.local_kv_heads(3, r, 3) for r in range(3)] == [[0], [1], [2]]
    assert [compat.local_kv_heads(8, r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [compat.local_kv_heads(2, r, 4) for r in range(4)] == [[0], [0], [1], [1]]  # replicated
    with pytest.raises(compat.VllmCompatError):
        compat.local_kv_heads(3, 0, 2)
