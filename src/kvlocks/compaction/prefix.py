"""A model's compacted prefix cache (:class:`CompactedPrefix`) and the model it was made for
(:class:`ModelInfo`): what a file holds and what serving checks.

Equal budgets: every compacted (layer, KV head) keeps the same t entries, so a layer is a
rectangular cache ``[Hkv, t, D]`` that stock engines can hold; a hybrid model's sliding-window
layer keeps its last min(T, W - 1) prefix tokens as they are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from .config import CompactionConfig

BIAS_METHODS = ("am", "rank1")  # methods whose cache needs a logit bias at serving time
_ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_parameters", "rope_theta")


@dataclass(frozen=True)
class ModelInfo:
    """What a compacted cache must match to be served by a model.

    Attributes
    ----------
    model_id : str
        Name or path the model was loaded from (informative).
    num_layers, num_q_heads, num_kv_heads, head_dim : int
    config_hash : str
        sha256 of the architecture fields that shape K/V (``_ARCH_FIELDS``).
    weights_hash : str
        sha256 of the first layer's ``k_proj`` and the last layer's ``v_proj`` weights, rounded
        to bfloat16 (so float32 and bfloat16 loads of one checkpoint agree).
    """

    model_id: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    config_hash: str
    weights_hash: str


def _text_config(model):
    return model.config.get_text_config(decoder=True)


def _attn_modules(model) -> list:
    layers = model.get_decoder().layers
    return [layer.self_attn for layer in layers]


def model_info(model, model_id: str | None = None) -> ModelInfo:
    """The :class:`ModelInfo` of a loaded model."""
    cfg = _text_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    arch = {f: getattr(cfg, f, None) for f in _ARCH_FIELDS}
    arch["head_dim"] = head_dim
    config_hash = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()
    attn = _attn_modules(model)
    h = hashlib.sha256()
    for w in (attn[0].k_proj.weight, attn[-1].v_proj.weight):
        h.update(w.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return ModelInfo(model_id=model_id or str(getattr(cfg, "_name_or_path", "")),
                     num_layers=cfg.num_hidden_layers, num_q_heads=cfg.num_attention_heads,
                     num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                     config_hash=config_hash, weights_hash=h.hexdigest())


def check_model(info: ModelInfo, model, where: str = "the compacted prefix") -> None:
    """Raise ``ValueError`` unless ``model`` is the model ``info`` describes (:func:`check_info`)."""
    check_info(info, model_info(model), where)


def check_info(info: ModelInfo, have: ModelInfo, where: str, what: str = "this model") -> None:
    """Raise ``ValueError`` unless ``have`` describes the model ``info`` describes.

    Layer count, head counts and head dim are compared first (the clearest message), then
    the architecture's config hash and the weights hash.
    """
    for field in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):
        if getattr(info, field) != getattr(have, field):
            raise ValueError(f"{where} was made for a model with {field}={getattr(info, field)} "
                             f"({info.model_id!r}); {what} has {field}={getattr(have, field)}")
    if info.config_hash != have.config_hash:
        raise ValueError(f"{where} was made for another model architecture ({info.model_id!r}): "
                         "config hash differs")
    if info.weights_hash != have.weights_hash:
        raise ValueError(f"{where} was made for a model with other weights ({info.model_id!r}): "
                         "weights hash differs")


@dataclass(frozen=True)
class CompactedPrefix:
    """A model's compacted prefix cache, every layer with the same t (module docstring).

    Attributes
    ----------
    keys : tuple of Tensor [Hkv, t, Dk], float32
        Post-RoPE keys at their original phase; Dk = D, or D+1 for ``rank1`` (beta appended).
    values : tuple of Tensor [Hkv, t, D], float32
    beta : tuple of Tensor [Hkv, t], float32, or None
        The logit bias serving must add (``am`` only).
    indices : tuple of Tensor [Hkv, t], int64
        Kept positions, ascending per head.
    prefix_len : int
        T: new tokens continue at position T.
    kept : int
        t.
    method : str
    config : CompactionConfig
    reference : str
        JSON of the :class:`~.passes.ReferenceConfig` used ("{}" if unknown).
    model : ModelInfo
    compact_seconds : float
        Capture plus compaction wall time (0 if unknown).
    windows : tuple of (int or None), or None
        Per layer: None for a compacted (global) layer, the window W for a sliding layer that
        keeps its last min(T, W - 1) prefix tokens exactly. None: every layer is global.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    beta: tuple[torch.Tensor, ...] | None
    indices: tuple[torch.Tensor, ...]
    prefix_len: int
    kept: int
    method: str
    config: CompactionConfig
    reference: str
    model: ModelInfo
    compact_seconds: float = 0.0
    windows: tuple[int | None, ...] | None = None

    @property
    def has_bias(self) -> bool:
        """Whether serving needs a logit bias (``am``, ``rank1``): no plain-cache kernel."""
        return self.method in BIAS_METHODS

    def serving_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys [Hkv, t, D], values [Hkv, t, D] and bias [Hkv, t] or None, as served.

        ``rank1`` keys ``[k, beta]`` read by ``q' = [q, 1/scale]`` give exactly the logits of
        ``k`` plus bias beta, so they are served as keys ``k`` with bias ``beta``.
        """
        k, v = self.keys[layer], self.values[layer]
        if self.method == "rank1":
            return k[..., :-1], v, k[..., -1]
        return k, v, (self.beta[layer] if self.beta is not None else None)


def identity_layer(k: torch.Tensor, v: torch.Tensor, method: str, first: int = 0):
    """Keep-all 'compaction' of the entries from position ``first`` on: keys, values, beta, indices."""
    k, v = k[:, first:].to(torch.float32), v[:, first:].to(torch.float32)
    hkv, num, _ = k.shape
    zero = torch.zeros(hkv, num)
    idx = torch.arange(first, first + num).expand(hkv, num).clone()
    if method == "rank1":
        k = torch.cat([k, zero[..., None]], dim=-1)  # [Hkv, T, D+1]
    return k, v, (zero if method == "am" else None), idx
