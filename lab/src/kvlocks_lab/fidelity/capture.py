"""Activation capture: post-RoPE keys, values and decode-time queries, stored as safetensors.

One dense forward pass over a :class:`~kvlocks_lab.fidelity.prompts.Prompt` (prefix +
teacher-forced continuation) gives, per layer and KV head, the keys and values of the prefix
and the post-RoPE queries of the last ``Q`` positions, kept per query head (query head
``h`` belongs to KV head ``h // G``). A causal model's query at position ``p`` is the same in a
single teacher-forced pass as in token-by-token decoding, so these are decode-time queries.

Queries are recorded by the compaction package's ``"kvlocks_compact"`` attention function
through the keys of its :class:`~kvlocks.integrations.hf.compaction.capture.RecordingCache` (no hooks, nothing
patched; the model's attention implementation is restored afterwards); the recorder here keeps
the last ``Q`` positions of every query head instead of a pooled subsample.

Files (:func:`save_capture` / :func:`load_capture`) hold four float32 tensors and JSON
metadata; :func:`load_capture` never unpickles, and rejects a file whose format, shapes, dtypes, checksums or carrier
positions do not check out.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = "kvlocks-fidelity-capture"
VERSION = 1
TENSORS = ("keys", "values", "queries", "scales")


@dataclass(frozen=True, eq=False)
class ActivationCapture:
    """Keys, values and queries of one prompt, all layers.

    keys, values : float32 ``[L, Hkv, N, D]``, post-RoPE keys / values of the N-token prefix
    queries : float32 ``[L, Hkv, G, Q, D]``, post-RoPE queries of the last Q positions
    scales : float32 ``[L]``, each layer's softmax scale
    page_size : S; N must be a multiple of it
    carrier_tokens : positions in ``[0, N)`` of the needle value (empty: no needle)
    meta : JSON-able description of the prompt (:meth:`Prompt.meta`) and the model
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    scales: torch.Tensor
    page_size: int
    carrier_tokens: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in TENSORS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise ValueError(f"ActivationCapture.{name} must be a float32 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
        k, v, q, s = self.keys, self.values, self.queries, self.scales
        if k.dim() != 4 or v.shape != k.shape:
            raise ValueError(f"keys/values must be [L, Hkv, N, D] of one shape, got {tuple(k.shape)} / "
                             f"{tuple(v.shape)}")
        if q.dim() != 5 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[3] < 1:
            raise ValueError(f"queries must be [L, Hkv, G, Q>=1, D] matching keys {tuple(k.shape)}, "
                             f"got {tuple(q.shape)}")
        if s.shape != (k.shape[0],):
            raise ValueError(f"scales must be [L={k.shape[0]}], got {tuple(s.shape)}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: must be an integer >= 1")
        n = k.shape[2]
        if n < self.page_size or n % self.page_size:
            raise ValueError(f"prefix length N={n} must be a positive multiple of page_size={self.page_size}")
        bad = [c for c in self.carrier_tokens if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < n]
        if bad:
            raise ValueError(f"carrier_tokens {bad[:5]} outside [0, N={n})")
        for name in TENSORS:
            t = getattr(self, name)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"ActivationCapture.{name} holds NaN/Inf")

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def num_pages(self) -> int:
        return self.keys.shape[2] // self.page_size

    @property
    def carrier_pages(self) -> tuple[int, ...]:
        """Pages holding a carrier token, ascending."""
        return tuple(sorted({c // self.page_size for c in self.carrier_tokens}))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """``(keys [Hkv, N, D], values [Hkv, N, D], queries [Hkv, Q, G, D], scale)`` of layer i."""
        return self.keys[i], self.values[i], self.queries[i].transpose(1, 2), float(self.scales[i])


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def save_capture(path: str | Path, cap: ActivationCapture) -> None:
    """Write ``cap`` to a safetensors file (tensors + JSON metadata with per-tensor SHA-256)."""
    from safetensors.torch import save_file

    tensors = {name: getattr(cap, name).contiguous() for name in TENSORS}
    header = {"page_size": cap.page_size, "carrier_tokens": list(cap.carrier_tokens), "meta": cap.meta,
              "sha256": {name: _digest(t) for name, t in tensors.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(VERSION), "header": json.dumps(header)})
    tmp.replace(path)


def load_capture(path: str | Path) -> ActivationCapture:
    """Read and validate a capture written by :func:`save_capture` (``ValueError`` if anything is off)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no capture file at {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            names = set(fh.keys())
            tensors = {n: fh.get_tensor(n) for n in names}
    except Exception as exc:  # safetensors raises its own error types for malformed files
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        raise ValueError(f"{path}: format {meta.get('format')!r} v{meta.get('version')!r}, "
                         f"expected {FORMAT!r} v{VERSION}")
    if names != set(TENSORS):
        raise ValueError(f"{path}: tensors {sorted(names)}, expected {sorted(TENSORS)}")
    try:
        header = json.loads(meta["header"])
        sums, page_size = header["sha256"], header["page_size"]
        carriers, info = tuple(header["carrier_tokens"]), header["meta"]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: malformed metadata header ({exc})") from None
    for name, t in tensors.items():
        if t.dtype == torch.float32 and sums.get(name) != _digest(t):
            raise ValueError(f"{path}: checksum mismatch in tensor {name!r} (file corrupted)")
    return ActivationCapture(**tensors, page_size=page_size, carrier_tokens=carriers, meta=info)


class _LastQueries:
    """Recorder for ``"kvlocks_compact"``: keeps each layer's last ``count`` query positions."""

    def __init__(self, count: int, num_kv_heads: int) -> None:
        self.count, self.hkv = count, num_kv_heads
        self.queries: dict[int, torch.Tensor] = {}
        self.scales: dict[int, float] = {}

    def add(self, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """``query [1, Hq, L, D]`` -> float32 ``[Hkv, G, Q, D]`` (last Q positions)."""
        if query.shape[0] != 1 or query.shape[2] < self.count:
            raise ValueError(f"capture needs batch 1 and >= {self.count} positions, got queries {tuple(query.shape)}")
        q = query[0, :, -self.count:, :].detach().float().cpu()  # [Hq, Q, D]
        self.queries[layer] = q.reshape(self.hkv, q.shape[0] // self.hkv, *q.shape[1:])  # [Hkv, G, Q, D]
        self.scales[layer] = float(scaling) if scaling is not None else q.shape[-1] ** -0.5


@torch.inference_mode()
def capture_prompt(model, prompt, *, queries: int, page_size: int) -> ActivationCapture:
    """Run ``model`` densely over ``prompt.ids`` and capture its prefix K/V and last queries.

    Parameters
    ----------
    model : a transformers GQA decoder (llama family) loaded by :func:`kvlocks.models.load`
    prompt : :class:`~kvlocks_lab.fidelity.prompts.Prompt`
    queries : Q, positions at the end of ``prompt.ids`` whose queries are kept
    page_size : S (``prompt.prefix_len`` must be a multiple)
    """
    from kvlocks.integrations.hf.compaction import attention as compact_attention
    from kvlocks.integrations.hf.compaction.capture import RecordingCache

    text = model.config.get_text_config(decoder=True)
    if len(prompt.ids) - prompt.prefix_len < queries:
        raise ValueError(f"{prompt.name}: {len(prompt.ids) - prompt.prefix_len} continuation tokens "
                         f"< queries={queries}")
    recorder = _LastQueries(queries, text.num_key_value_heads)
    cache = RecordingCache(model.config, recorder)
    ids = torch.tensor([list(prompt.ids)], dtype=torch.long, device=model.device)  # [1, T]
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with compact_attention.using(model):
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
    n, layers = prompt.prefix_len, range(text.num_hidden_layers)
    missing = [i for i in layers if i not in recorder.queries]
    if missing:
        raise ValueError(f"no queries recorded for layers {missing[:5]}: does the model use kvlocks attention?")
    keys = torch.stack([cache.layers[i].keys[0, :, :n].float().cpu() for i in layers])  # [L, Hkv, N, D]
    values = torch.stack([cache.layers[i].values[0, :, :n].float().cpu() for i in layers])
    qs = torch.stack([recorder.queries[i] for i in layers])  # [L, Hkv, G, Q, D]
    scales = torch.tensor([recorder.scales[i] for i in layers], dtype=torch.float32)
    meta = {**prompt.meta(), "model_type": text.model_type, "query_start": len(prompt.ids) - queries}
    return ActivationCapture(keys=keys.contiguous(), values=values.contiguous(), queries=qs.contiguous(),
                             scales=scales, page_size=page_size, carrier_tokens=tuple(prompt.carrier_tokens),
                             meta=meta)
