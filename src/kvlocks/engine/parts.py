"""The pieces of a Hugging Face decoder the engine calls: the model's own modules, nothing copied.

Supported: decoders whose layers are ``input_layernorm -> self_attn(q/k/v/o_proj, RoPE) ->
post_attention_layernorm -> mlp`` with a shared ``rotary_emb`` and a module-level
``apply_rotary_pos_emb`` next to the attention class: Llama (and SmolLM2), Qwen2 and GLM
(``GlmForCausalLM``, partial interleaved rotary). The engine calls each module's ``forward``,
and the attention module's own ``apply_rotary_pos_emb``, so the math is the model's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

SUPPORTED_TYPES = ("llama", "qwen2", "glm")


@dataclass
class ModelParts:
    """Submodules and shapes of one decoder (see the module docstring).

    embed, norm, lm_head, rotary : the model's embedding, final norm, LM head, rotary embedding
    layers : its decoder layers (each with ``input_layernorm``, ``self_attn``,
        ``post_attention_layernorm``, ``mlp``)
    apply_rope : the attention module's ``apply_rotary_pos_emb(q, k, cos, sin)``
    num_q_heads, num_kv_heads, head_dim, scale : Hq, Hkv, D and the softmax scale
    """

    embed: torch.nn.Module
    layers: list
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary: torch.nn.Module
    apply_rope: object
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every parameter except the embedding table (one
        row per sequence is read), which counts in full only when tied to the LM head."""
        seen, total = set(), 0
        skip = self.embed.weight if self.embed.weight is not self.lm_head.weight else None
        for mod in (self.norm, self.lm_head, *self.layers):
            for p in mod.parameters():
                if id(p) not in seen and p is not skip:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
        return total


def model_parts(model) -> ModelParts:
    """Extract :class:`ModelParts` from a ``*ForCausalLM``; ValueError for unsupported models."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted({t for t in types if t != "full_attention"})
    if getattr(cfg, "use_sliding_window", False) or other:
        n = sum(t != "full_attention" for t in types)
        raise ValueError(f"model_type {mtype!r} has {n or 'all'} of {len(types) or 'its'} layers of type "
                         f"{other or ['sliding_attention']}: the engine's static cache, decode plan and RoPE "
                         "have one full-attention layer type (no per-layer window, no per-layer-type RoPE); "
                         "decode this model on the Hugging Face path (kvlocks generate without --engine), "
                         "where sliding layers keep their window and global layers run LOCKS")
    if mtype not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {mtype!r} is not supported by the engine; allowed {SUPPORTED_TYPES}")
    base = model.model
    layers = list(base.layers)
    attn = layers[0].self_attn
    apply_rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply_rope is None:
        raise ValueError(f"{type(attn).__name__}'s module has no apply_rotary_pos_emb")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(attn, name):
            raise ValueError(f"{type(attn).__name__} has no {name}; the engine needs separate q/k/v/o projections")
    d = attn.head_dim
    hq = attn.q_proj.out_features // d
    hkv = attn.k_proj.out_features // d
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of KV heads {hkv}")
    w = attn.q_proj.weight
    return ModelParts(
        embed=base.embed_tokens, layers=layers, norm=base.norm, lm_head=model.lm_head, rotary=base.rotary_emb,
        apply_rope=apply_rope, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, scale=float(attn.scaling),
        dtype=w.dtype, device=w.device,
    )


def project_qkv(parts: ModelParts, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv=None):
    """Input norm, q/k/v projections and the model's RoPE for tokens ``x [B, L, H]``.

    ``qkv``: optional ``(W_qkv, b_qkv)`` of :func:`kvlocks.engine.fused.fused_qkv` (the layer's three
    projection weights in one matrix): one product, split, instead of the three modules' calls.
    Returns q ``[B, Hq, L, D]``, k and v ``[B, Hkv, L, D]`` (post-RoPE q and k), as the model's
    attention module computes them.
    """
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    bsz, n = x.shape[:2]
    d = parts.head_dim
    if qkv is None:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    else:
        nq, nkv = parts.num_q_heads * d, parts.num_kv_heads * d
        q, k, v = torch.nn.functional.linear(h, qkv[0], qkv[1]).split([nq, nkv, nkv], dim=-1)
    q = q.reshape(bsz, n, -1, d).transpose(1, 2)
    k = k.reshape(bsz, n, -1, d).transpose(1, 2)
    v = v.reshape(bsz, n, -1, d).transpose(1, 2)
    q, k = parts.apply_rope(q, k, cos, sin)
    return q, k, v


def project_and_write(parts: ModelParts, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qkv,
                      k_flat: torch.Tensor, v_flat: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """:func:`project_qkv` for one new token per sequence (``x [B, 1, H]``), its key and value written
    to rows ``slot [B]`` of the flattened caches ``k_flat``/``v_flat [rows, Hkv, D]``; returns q
    ``[B, Hq, D]`` (contiguous). Compiled, the writes join the projection's own kernels."""
    q, k, v = project_qkv(parts, layer, x, cos, sin, qkv)
    k_flat.index_copy_(0, slot, k[:, :, 0])
    v_flat.index_copy_(0, slot, v[:, :, 0])
    return q[:, :, 0].contiguous()


def finish_layer(layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Residual adds around ``o_proj`` and the MLP: ``x [B, L, H]``, attn_out ``[B, L, Hq * D]``."""
    x = x + layer.self_attn.o_proj(attn_out)
    return x + layer.mlp(layer.post_attention_layernorm(x))
