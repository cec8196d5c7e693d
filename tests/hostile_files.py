"""Hostile and broken compacted-cache files, one per way a file can be wrong, made from a valid one.

Shared by the cache loader's test (``tests/test_compaction_model.py``) and the vLLM connector's
(``tests/vllm/compact_ref.py`` writes them, ``tests/vllm/test_connector.py`` sends them). Each case
is ``name -> (make(src, dst), fragment)``: ``make`` writes the bad file, ``fragment`` is a piece of
the refusal message. Cases marked consistent recompute the checksum, as an attacker who knows the
format would, so the check that must catch them is the one named, not the checksum.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _rewrite(src: Path, dst: Path, edit, *, consistent: bool = True) -> None:
    """Copy ``src`` with ``edit(meta, tensors)`` applied; a correct new checksum if ``consistent``."""
    from kvlocks.compaction.cachefile import checksum

    with safe_open(str(src), framework="pt", device="cpu") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    edit(meta, tensors)
    if consistent:
        meta["checksum"] = checksum(meta, tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst), metadata=meta)


def _bytes(fn):
    def make(src: Path, dst: Path) -> None:
        dst.write_bytes(fn(src.read_bytes()))
    return make


def _edit(fn, *, consistent: bool = True):
    def make(src: Path, dst: Path) -> None:
        _rewrite(src, dst, fn, consistent=consistent)
    return make


def _tensor(name: str, fn, *, consistent: bool = True):
    def edit(meta, tensors):
        tensors[name] = fn(tensors[name])
    return _edit(edit, consistent=consistent)


def _meta(**fields):
    def edit(meta, tensors):
        meta.update(fields)
    return _edit(edit)


def _huge_declared_shape(src: Path, dst: Path) -> None:
    """A safetensors header declaring a 4 TB tensor over a few bytes of data."""
    with safe_open(str(src), framework="pt", device="cpu") as f:
        meta = dict(f.metadata())
    n = 1 << 40
    header = {"__metadata__": meta, "layers.0.keys": {"dtype": "F32", "shape": [1, n, 1], "data_offsets": [0, 4 * n]}}
    raw = json.dumps(header).encode()
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * 64)


def _huge_header_length(src: Path, dst: Path) -> None:
    """The first 8 bytes claim an 8 EB header."""
    dst.write_bytes(struct.pack("<Q", (1 << 63) - 1) + src.read_bytes()[8:])


def _heads(n: int):
    def edit(meta, tensors):  # shapes consistent with another KV head count
        meta["num_kv_heads"] = str(n)
        for k, v in list(tensors.items()):
            tensors[k] = torch.cat([v, v[:1]], dim=0) if n > v.shape[0] else v[:n]
    return _edit(edit)


def _biased(meta, tensors):  # an "am" file: keeps beta, needs a logit bias
    cfg = json.loads(meta["compaction_config"])
    cfg["method"] = meta["method"] = "am"
    meta["compaction_config"] = json.dumps(cfg)
    for k in [k for k in tensors if k.endswith(".indices")]:
        tensors[k.replace(".indices", ".beta")] = torch.zeros(tensors[k].shape, dtype=torch.float32)


def _extra(meta, tensors):  # a payload beside the expected tensors
    tensors["__payload__"] = torch.zeros(16, dtype=torch.uint8)


def _flip_last_data_byte(data: bytes) -> bytes:
    return data[:-10] + bytes([data[-10] ^ 1]) + data[-9:]


# name -> (make, fragment of the refusal); every one of these must be refused on load
CASES = {
    "empty": (_bytes(lambda d: b""), "not a readable safetensors"),
    "truncated": (_bytes(lambda d: d[: len(d) // 2]), "not a readable safetensors"),
    "garbage": (_bytes(lambda d: b"\x00" * 64), "not a readable safetensors"),
    "huge_header_length": (_huge_header_length, "not a readable safetensors"),
    "huge_declared_shape": (_huge_declared_shape, "not a readable safetensors"),
    "tampered_data": (_bytes(_flip_last_data_byte), "checksum"),
    "tampered_metadata": (_edit(lambda m, t: m.update(compact_seconds="0.000"), consistent=False), "checksum"),
    "other_format": (_meta(format="other-cache"), "format="),
    "other_version": (_meta(format_version="9"), "format_version="),
    "missing_metadata": (_edit(lambda m, t: m.pop("weights_hash")), "metadata lacks"),
    "t_above_T": (_meta(t="100000"), "1 <= t <= T"),
    "declared_t_huge": (_meta(t="1000000", T="1000000"), "has shape"),
    "wrong_dtype": (_tensor("layers.2.keys", lambda x: x.half()), "has shape"),
    "wrong_shape": (_tensor("layers.3.values", lambda x: x[:, :-1]), "has shape"),
    "missing_tensor": (_edit(lambda m, t: t.pop("layers.7.values")), "wrong tensor set"),
    "extra_tensor": (_edit(_extra), "wrong tensor set"),
    "nan": (_tensor("layers.5.keys", lambda x: x.index_fill(1, torch.tensor([2]), math.nan)), "NaN/Inf"),
    "inf": (_tensor("layers.1.values", lambda x: x.index_fill(1, torch.tensor([0]), math.inf)), "NaN/Inf"),
    "indices_unordered": (_tensor("layers.0.indices", lambda x: x.flip(1)), "strictly ascending"),
    "indices_out_of_range": (_tensor("layers.4.indices", lambda x: x + 10**6), "strictly ascending"),
    "other_layer_count": (_meta(num_layers="31"), "num_layers=31"),
    "other_kv_heads": (_heads(4), "num_kv_heads=4"),
    "other_head_dim": (_meta(head_dim="128"), "head_dim=128"),
    "other_weights": (_meta(weights_hash="0" * 64), "weights"),
    "other_config": (_meta(config_hash="0" * 64), "config"),
}

# refused by the connector only: loadable files that vLLM cannot serve
SERVE_ONLY = {"biased": (_edit(_biased), "logit bias")}


def write_cases(src: Path, out: Path, cases: dict | None = None) -> dict[str, str]:
    """Write every case (default :data:`CASES`) next to each other in ``out``; name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (make, _) in (cases or CASES).items():
        dst = out / f"bad_{name}.safetensors"
        make(Path(src), dst)
        paths[name] = str(dst)
    return paths
