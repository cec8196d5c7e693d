"""One safetensors file per compacted prefix: save, and load with validation (never pickle).

Format ``kvlocks-compacted-cache``, version 1. Tensors, for every layer i:

* ``layers.{i}.keys``    float32 [Hkv, t, Dk]  (Dk = D, or D+1 for ``rank1``: beta appended)
* ``layers.{i}.values``  float32 [Hkv, t, D]
* ``layers.{i}.indices`` int64   [Hkv, t]      kept positions, strictly ascending, in [0, T)
* ``layers.{i}.beta``    float32 [Hkv, t]      ``am`` only

A hybrid model's file also has ``layer_windows`` (JSON: per layer null, or the window W of a
sliding layer); a sliding layer holds its last w = min(T, W - 1) prefix tokens as they are (shapes
with w for t, indices T - w .. T - 1, zero bias).

Metadata (all strings): ``format``, ``format_version``, ``model_id``, ``num_layers``,
``num_q_heads``, ``num_kv_heads``, ``head_dim``, ``config_hash``, ``weights_hash``, ``T``,
``t``, ``method``, ``compaction_config`` (JSON), ``reference_config`` (JSON),
``compact_seconds``, ``kvlocks_version`` and ``checksum``: ``sha256:`` of the other metadata
(sorted JSON) followed by, for each tensor in name order, its name, dtype, shape and bytes.

:func:`load` rejects, with a ``ValueError`` saying what is wrong: unreadable or truncated
files, another format or version, missing metadata, a checksum mismatch (tampered tensor or
metadata), a model other than the one given (layer count, KV heads, head dim, config hash,
weights hash), missing/extra tensors, wrong shapes or dtypes, NaN/Inf, bad indices, beta
outside its box. Names, shapes and dtypes are checked from the header before any tensor data is
read (:func:`inspect`), so a file declaring huge tensors is refused without allocating them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import METHODS, CompactionConfig
from .prefix import CompactedPrefix, ModelInfo, check_model

logger = logging.getLogger(__name__)

FORMAT = "kvlocks-compacted-cache"
FORMAT_VERSION = "1"
_INT_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "T", "t")
_REQUIRED = ("format", "format_version", "model_id", *_INT_FIELDS, "config_hash", "weights_hash",
             "method", "compaction_config", "reference_config", "compact_seconds", "checksum")


def checksum(metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """``sha256:<hex>`` over the metadata (minus ``checksum``) and every tensor's bytes."""
    h = hashlib.sha256()
    meta = {k: v for k, v in metadata.items() if k != "checksum"}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        x = tensors[name].detach().to("cpu").contiguous()
        h.update(f"\n{name}|{x.dtype}|{list(x.shape)}\n".encode())
        h.update(x.view(torch.uint8).numpy().tobytes() if x.numel() else b"")
    return "sha256:" + h.hexdigest()


def save(path: str | Path, prefix: CompactedPrefix) -> Path:
    """Write ``prefix`` to ``path`` (one safetensors file); returns the path."""
    from kvlocks import __version__

    tensors = {}
    for i in range(prefix.model.num_layers):
        tensors[f"layers.{i}.keys"] = prefix.keys[i].to(torch.float32).contiguous()
        tensors[f"layers.{i}.values"] = prefix.values[i].to(torch.float32).contiguous()
        tensors[f"layers.{i}.indices"] = prefix.indices[i].to(torch.int64).contiguous()
        if prefix.beta is not None:
            tensors[f"layers.{i}.beta"] = prefix.beta[i].to(torch.float32).contiguous()
    m = prefix.model
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model_id": m.model_id,
            "num_layers": str(m.num_layers), "num_q_heads": str(m.num_q_heads),
            "num_kv_heads": str(m.num_kv_heads), "head_dim": str(m.head_dim),
            "config_hash": m.config_hash, "weights_hash": m.weights_hash,
            "T": str(prefix.prefix_len), "t": str(prefix.kept), "method": prefix.method,
            "compaction_config": prefix.config.to_json(), "reference_config": prefix.reference,
            "compact_seconds": f"{prefix.compact_seconds:.3f}", "kvlocks_version": __version__}
    if prefix.windows is not None:
        meta["layer_windows"] = json.dumps(list(prefix.windows))
    meta["checksum"] = checksum(meta, tensors)
    path = Path(path)
    save_file(tensors, str(path), metadata=meta)
    logger.info("saved %s cache T=%d t=%d to %s", prefix.method, prefix.prefix_len, prefix.kept, path)
    return path


_DTYPES = {"F32": torch.float32, "I64": torch.int64}  # the header's dtype names this format uses


def _open(path: Path):
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such compacted-cache file")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError)
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None


def _header(path: Path, f) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    """Metadata and each tensor's declared (shape, dtype name), read from the header only."""
    meta = f.metadata()
    if not meta:
        raise ValueError(f"{path}: safetensors file without metadata; not a {FORMAT} file")
    declared = {}
    for name in f.keys():
        sl = f.get_slice(name)
        declared[name] = (tuple(int(n) for n in sl.get_shape()), str(sl.get_dtype()))
    return meta, declared


def _tensors(path: Path, f) -> dict[str, torch.Tensor]:
    try:
        return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - data that the header promised but the file lacks
        raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None


def _check_meta(path: Path, meta: dict[str, str]) -> dict[str, int]:
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format={meta.get('format')!r}; expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version={meta.get('format_version')!r}; this kvlocks "
                         f"reads version {FORMAT_VERSION!r}")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise ValueError(f"{path}: metadata lacks {missing}")
    try:
        ints = {k: int(meta[k]) for k in _INT_FIELDS}
    except ValueError:
        raise ValueError(f"{path}: metadata {[meta[k] for k in _INT_FIELDS]} for {_INT_FIELDS} "
                         "must be integers") from None
    if min(ints.values()) < 1 or ints["t"] > ints["T"]:
        raise ValueError(f"{path}: need positive sizes and 1 <= t <= T, got {ints}")
    if meta["method"] not in METHODS:
        raise ValueError(f"{path}: method={meta['method']!r}; allowed {METHODS}")
    return ints


def _windows(path: Path, meta: dict[str, str], num_layers: int) -> tuple[int | None, ...] | None:
    """The ``layer_windows`` metadata (module docstring), validated; None when absent."""
    if "layer_windows" not in meta:
        return None
    try:
        windows = json.loads(meta["layer_windows"])
    except ValueError:
        windows = None
    if (not isinstance(windows, list) or len(windows) != num_layers
            or not all(w is None or (type(w) is int and w >= 1) for w in windows)):
        raise ValueError(f"{path}: layer_windows={meta['layer_windows'][:80]!r}: must be a JSON list of "
                         f"{num_layers} entries, each null or a window of >= 1 token")
    return tuple(windows)


def _kept(ints: dict[str, int], windows, i: int) -> int:
    """Entries layer ``i`` holds: t, or a sliding layer's last min(T, W - 1) tokens."""
    w = None if windows is None else windows[i]
    return ints["t"] if w is None else min(ints["T"], w - 1)


def _expected(ints: dict[str, int], method: str, windows=None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor a file of this header must hold: name -> (shape, dtype)."""
    hkv, d = ints["num_kv_heads"], ints["head_dim"]
    dk = d + 1 if method == "rank1" else d
    out = {}
    for i in range(ints["num_layers"]):
        t = _kept(ints, windows, i)
        out[f"layers.{i}.keys"] = ((hkv, t, dk), torch.float32)
        out[f"layers.{i}.values"] = ((hkv, t, d), torch.float32)
        out[f"layers.{i}.indices"] = ((hkv, t), torch.int64)
        if method == "am":
            out[f"layers.{i}.beta"] = ((hkv, t), torch.float32)
    return out


def _check_declared(path: Path, declared, expected) -> None:
    """Tensor names, shapes and dtypes as the header declares them, before any data is read (a
    hostile file cannot make the loader allocate what its metadata does not account for)."""
    if set(declared) != set(expected):
        missing, extra = sorted(set(expected) - set(declared))[:4], sorted(set(declared) - set(expected))[:4]
        raise ValueError(f"{path}: wrong tensor set for its header: missing {missing}, unexpected {extra}")
    for name, (shape, dtype) in expected.items():
        got_shape, got_dtype = declared[name]
        if got_shape != shape or _DTYPES.get(got_dtype) != dtype:
            raise ValueError(f"{path}: tensor {name} has shape {got_shape} {got_dtype}; expected {shape} {dtype}")


def _finite(path: Path, tensors, name: str) -> torch.Tensor:
    x = tensors[name]
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{path}: tensor {name} contains {int((~torch.isfinite(x)).sum())} "
                         "NaN/Inf values")
    return x


def _layer(path: Path, tensors, i: int, ints: dict[str, int], method: str, cfg: CompactionConfig, windows=None):
    num = ints["T"]
    k = _finite(path, tensors, f"layers.{i}.keys")
    v = _finite(path, tensors, f"layers.{i}.values")
    idx = tensors[f"layers.{i}.indices"]
    if int(idx.min()) < 0 or int(idx.max()) >= num or (idx.shape[1] > 1 and not bool((idx.diff(dim=1) > 0).all())):
        raise ValueError(f"{path}: layers.{i}.indices must be strictly ascending positions in "
                         f"[0, T={num})")
    if windows is not None and windows[i] is not None and int(idx[:, 0].min()) != num - idx.shape[1]:
        raise ValueError(f"{path}: layers.{i} is a sliding-window layer; its indices must be the prefix's "
                         f"last {idx.shape[1]} positions")
    beta = _finite(path, tensors, f"layers.{i}.beta") if method == "am" else None
    bias = beta if beta is not None else (k[..., -1] if method == "rank1" else None)
    if bias is not None and not bool(((bias >= cfg.beta_min - 1e-4) & (bias <= cfg.beta_max + 1e-4)).all()):
        raise ValueError(f"{path}: layer {i} beta outside [{cfg.beta_min}, {cfg.beta_max}]")
    return k, v, beta, idx


def _inspect(path: Path, f, model_check=None):
    """(metadata, integer fields, compaction config, model info, layer windows) of a valid header."""
    meta, declared = _header(path, f)
    ints = _check_meta(path, meta)
    method = meta["method"]
    try:
        cfg = CompactionConfig.from_json(meta["compaction_config"])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: bad compaction_config: {exc}") from None
    if cfg.method != method:
        raise ValueError(f"{path}: method={method!r} but compaction_config says {cfg.method!r}")
    info = ModelInfo(model_id=meta["model_id"], num_layers=ints["num_layers"],
                     num_q_heads=ints["num_q_heads"], num_kv_heads=ints["num_kv_heads"],
                     head_dim=ints["head_dim"], config_hash=meta["config_hash"],
                     weights_hash=meta["weights_hash"])
    if model_check is not None:  # "made for another model" says more than the shapes that follow from it
        model_check(info)
    windows = _windows(path, meta, ints["num_layers"])
    _check_declared(path, declared, _expected(ints, method, windows))
    return meta, ints, cfg, info, windows


def _check_windows(path: Path, windows, model) -> None:
    """``ValueError`` unless the file's sliding-window layers are the model's."""
    from kvlocks.hybrid import layer_windows

    have = layer_windows(model.config)
    if (windows or (None,) * len(have)) != have:
        raise ValueError(f"{path}: its sliding-window layers {windows} are not this model's {list(have)}")


def inspect(path: str | Path, model_check=None) -> tuple[dict[str, str], CompactionConfig, ModelInfo]:
    """Validate a file's header without reading its tensor data: format, metadata, and every
    tensor's name, shape and dtype as declared. Returns (metadata, compaction config, model info).
    ``model_check(info)``, if given, runs before the shape checks (and raises for another model).
    The checksum and the values (NaN/Inf, indices, beta) are checked by :func:`load`."""
    path = Path(path)
    with _open(path) as f:
        meta, _, cfg, info, _ = _inspect(path, f, model_check)
    return meta, cfg, info


def load(path: str | Path, model=None) -> CompactedPrefix:
    """Read and validate a compacted-cache file (module docstring for what is checked).

    Parameters
    ----------
    path : str or Path
    model : optional
        If given, the file must have been made for this model (shapes, config and weights hash).

    Returns
    -------
    CompactedPrefix (tensors float32 / int64 on CPU)
    """
    path = Path(path)
    with _open(path) as f:
        check = None if model is None else (lambda info: check_model(info, model, where=str(path)))
        meta, ints, cfg, info, windows = _inspect(path, f, check)
        if model is not None:
            _check_windows(path, windows, model)
        tensors = _tensors(path, f)
    if meta["checksum"] != checksum(meta, tensors):
        raise ValueError(f"{path}: checksum mismatch: the tensors or metadata were changed after "
                         "saving (or the file is corrupt)")
    method = meta["method"]
    layers = [_layer(path, tensors, i, ints, method, cfg, windows) for i in range(info.num_layers)]
    try:
        seconds = float(meta["compact_seconds"])
    except ValueError:
        raise ValueError(f"{path}: compact_seconds={meta['compact_seconds']!r} is not a number") from None
    return CompactedPrefix(
        keys=tuple(x[0] for x in layers), values=tuple(x[1] for x in layers),
        beta=tuple(x[2] for x in layers) if method == "am" else None,
        indices=tuple(x[3] for x in layers), prefix_len=ints["T"], kept=ints["t"], method=method,
        config=cfg, reference=meta["reference_config"], model=info, compact_seconds=seconds, windows=windows)
