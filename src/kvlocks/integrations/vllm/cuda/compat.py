"""The CUDA half of the vLLM bridge: every vLLM internal the CUDA LOCKS backend reads goes through here.

:mod:`kvlocks.integrations.vllm.compat` holds the CPU backend's and the connector's; this module the
FlashAttention backend's: the stock classes to subclass, the registry entry, the paged KV cache
layout, the fields of the per-batch metadata, the attention layers of a metadata builder and the
CUDA-graph support levels. Each is checked, and anything unknown raises
:class:`~kvlocks.integrations.vllm.compat.VllmCompatError` naming what was expected.

Written against vLLM 0.26.0 (CUDA 13 build, FlashAttention 3 on sm_90) and checked to import, with
the same cache convention and metadata fields, in vLLM 0.32.0 (the CPU build's Python sources). In
both the layer's cache is ``(num_blocks, Hkv, block_size, 2 * D)`` (0.26:
``FlashAttentionBackend.get_kv_cache_shape``; 0.32 moved it to ``kv_cache_interface``), stored
``[num_blocks, block_size, Hkv, 2 * D]`` (layout "NHD", the default) or as shaped ("HND"), and the
backend reads it as ``kv_cache.transpose(1, 2).split(D, dim=-1)``: keys
and values ``[num_blocks, block_size, Hkv, D]`` with a unit last stride, the layout kvlocks' paged
kernels take (``docs/paged-layout.md``). vLLM 0.24.0 shapes it ``(num_blocks, 2, block_size, Hkv, D)``
(stored so, "NHD", or ``[num_blocks, 2, Hkv, block_size, D]``, "HND") and reads it as
``kv_cache.unbind(1)``; older vLLMs stored ``[2, num_blocks, block_size, Hkv, D]``.
:func:`split_flash_kv_cache` reads all three (:data:`KV_FORMS`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass

import torch

from kvlocks.integrations.vllm.compat import VllmCompatError, vllm_version
from kvlocks.pages import num_pages

log = logging.getLogger(__name__)

TESTED_CUDA_VLLM_VERSIONS = ("0.26.0",)
CUDA_BACKEND_PATH = "kvlocks.integrations.vllm.cuda.backend.LocksFlashAttentionBackend"


def stock_flash_classes():
    """``(FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder)``, or a loud error."""
    try:
        from vllm.v1.attention.backends.flash_attn import (
            FlashAttentionBackend,
            FlashAttentionImpl,
            FlashAttentionMetadataBuilder,
        )
    except ImportError as exc:
        raise VllmCompatError(
            f"vLLM {vllm_version()} has no vllm.v1.attention.backends.flash_attn FlashAttentionBackend/Impl/"
            f"MetadataBuilder (tested: {TESTED_CUDA_VLLM_VERSIONS}): {exc}") from exc
    return FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder


def cg_support(name: str):
    """The ``AttentionCGSupport`` member ``name`` (``"UNIFORM_SINGLE_TOKEN_DECODE"``, ...)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    if name not in AttentionCGSupport.__members__:
        raise VllmCompatError(f"vLLM {vllm_version()} has no AttentionCGSupport.{name}")
    return AttentionCGSupport[name]


def register_cuda_backend() -> None:
    """Point vLLM's ``FLASH_ATTN`` registry entry at the LOCKS backend (imported only when vLLM
    resolves it: in the worker, after the platform chose FLASH_ATTN)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if "FLASH_ATTN" not in AttentionBackendEnum.__members__:
        raise VllmCompatError(f"vLLM {vllm_version()} has no AttentionBackendEnum.FLASH_ATTN")
    register_backend(AttentionBackendEnum.FLASH_ATTN, CUDA_BACKEND_PATH)
    if vllm_version() not in TESTED_CUDA_VLLM_VERSIONS:
        log.warning("kvlocks: CUDA vLLM %s is untested (tested: %s)", vllm_version(), TESTED_CUDA_VLLM_VERSIONS)


def is_cuda_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def batch_invariant() -> bool:
    """Whether vLLM runs in its batch-invariant mode (``VLLM_BATCH_INVARIANT``, an integer read as vLLM
    reads it: a request's outputs do not depend on the requests batched with it); the LOCKS plans
    then launch as for one row (``KernelOptions.batch_invariant``)."""
    value = os.environ.get("VLLM_BATCH_INVARIANT", "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_BATCH_INVARIANT={value!r}: allowed an integer (0 off, 1 on)") from None


def is_capturing() -> bool:
    """Inside a CUDA graph capture on the current stream (the run path must not sync then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The FlashAttention cache conventions kvlocks reads, by the logical shape vLLM gives the layer's tensor:
KV_FORMS = {
    "packed": "[NB, Hkv, BS, 2D], read as kv_cache.transpose(1, 2).split(D, -1) (vLLM 0.26-0.32)",
    "blocks_first": "[NB, 2, BS, Hkv, D], read as kv_cache.unbind(1) (vLLM 0.24)",
    "kv_first": "[2, NB, BS, Hkv, D], read as kv_cache.unbind(0) (older vLLMs)",
}


def kv_forms(shape, num_kv_heads: int, head_size: int) -> list[str]:
    """The :data:`KV_FORMS` a cache of logical ``shape`` can be: one, none, or at ``NB = 2`` both 5-dim forms."""
    shape, h, d = tuple(shape), num_kv_heads, head_size
    forms = []
    if len(shape) == 4 and shape[1] == h and shape[3] == 2 * d:
        forms.append("packed")
    if len(shape) == 5 and shape[1] == 2 and shape[3:] == (h, d):
        forms.append("blocks_first")
    if len(shape) == 5 and shape[0] == 2 and shape[3:] == (h, d):
        forms.append("kv_first")
    return forms


@functools.lru_cache(maxsize=None)
def declared_kv_form(num_kv_heads: int, head_size: int) -> str | None:
    """The :data:`KV_FORMS` entry vLLM's stock ``FlashAttentionBackend.get_kv_cache_shape`` declares,
    asked for 3 blocks of 16 tokens (3 blocks: no form is ambiguous); None where the backend has no
    such method (vLLM 0.32 moved it to ``kv_cache_interface``)."""
    get_shape = getattr(stock_flash_classes()[0], "get_kv_cache_shape", None)
    if get_shape is None:
        return None
    shape = tuple(get_shape(3, 16, num_kv_heads, head_size))
    forms = kv_forms(shape, num_kv_heads, head_size)
    if len(forms) != 1:
        raise VllmCompatError(f"FlashAttentionBackend.get_kv_cache_shape(3, 16, {num_kv_heads}, {head_size}) = "
                              f"{shape} is none of the known forms {KV_FORMS} (vLLM {vllm_version()})")
    return forms[0]


def split_flash_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
    """One layer's FlashAttention cache -> ``(keys, values)``, each a view ``[NB, BS, Hkv, D]``.

    ``kv_cache`` in any of :data:`KV_FORMS` (any stride order), recognised by its shape; a 5-dim
    cache of 2 blocks fits both 5-dim forms, and the form the stock backend declares
    (:func:`declared_kv_form`) decides.
    """
    d = head_size
    forms = kv_forms(kv_cache.shape, num_kv_heads, d)
    if len(forms) > 1:
        declared = declared_kv_form(num_kv_heads, d)
        if declared not in forms:
            raise VllmCompatError(
                f"FlashAttention KV cache shape {tuple(kv_cache.shape)} fits {forms} and the stock backend "
                f"declares {declared}: cannot tell which (vLLM {vllm_version()})")
        forms = [declared]
    if not forms:
        raise VllmCompatError(
            f"unknown FlashAttention KV cache shape {tuple(kv_cache.shape)}: expected [num_blocks, "
            f"Hkv={num_kv_heads}, block_size, 2*D={2 * d}], [num_blocks, 2, block_size, Hkv, D] or "
            f"[2, num_blocks, block_size, Hkv, D] (vLLM {vllm_version()})")
    if forms[0] == "packed":
        keys, values = kv_cache.transpose(1, 2).split(d, dim=-1)  # as FlashAttentionImpl reads it
    else:
        keys, values = kv_cache.unbind(1 if forms[0] == "blocks_first" else 0)  # [NB, BS, Hkv, D] each
    if keys.stride(-1) != 1 or keys.stride() != values.stride():
        raise VllmCompatError(f"KV cache views with strides {keys.stride()} / {values.stride()}: the kernels "
                              "need equal key/value strides and a unit stride along head_dim")
    return keys, values


def layer_kv_cache(layer) -> torch.Tensor | None:
    """The attention layer's bound KV cache tensor (None before vLLM allocated it)."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):  # one entry per virtual engine in older versions
        kv = kv[0] if kv else None
    if kv is None or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
        return None
    return kv


def attention_layers(vllm_config, layer_names) -> dict:
    """``{name: Attention layer}`` for a metadata builder's layers."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(vllm_config, Attention, list(layer_names))


@dataclass
class BatchView:
    """The ``CommonAttentionMetadata`` fields the LOCKS builder reads (device tensors unless _cpu)."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R], tokens including this step's
    block_table: torch.Tensor  # int32 [R, max_blocks]
    causal: bool
    max_seq_len: int | None = None  # host: the longest row, or more (None: this vLLM does not say)
    decode_rows: int | None = None  # host: rows of one query token (None: no host copy of query_start_loc)


def batch_view(common) -> BatchView:
    names = ("num_reqs", "num_actual_tokens", "max_query_len", "query_start_loc", "seq_lens", "block_table_tensor")
    missing = [n for n in names if not hasattr(common, n)]
    if missing:
        raise VllmCompatError(f"CommonAttentionMetadata lacks {missing} (vLLM {vllm_version()})")
    r = int(common.num_reqs)
    causal = getattr(common, "causal", True)
    longest = getattr(common, "max_seq_len", None)
    qsl_cpu = getattr(common, "query_start_loc_cpu", None)
    decode_rows = None
    if isinstance(qsl_cpu, torch.Tensor) and qsl_cpu.device.type == "cpu":
        decode_rows = int(((qsl_cpu[1 : r + 1] - qsl_cpu[:r]) == 1).sum())
    return BatchView(num_reqs=r, num_tokens=int(common.num_actual_tokens), max_query_len=int(common.max_query_len),
                     query_start_loc=common.query_start_loc[: r + 1], seq_lens=common.seq_lens[:r],
                     block_table=common.block_table_tensor[:r], causal=causal is True,
                     max_seq_len=None if longest is None else int(longest), decode_rows=decode_rows)


def replace_common(common, **fields):
    """A copy of ``CommonAttentionMetadata`` with ``fields`` replaced."""
    return dataclasses.replace(common, **fields)


def engine_limits(vllm_config) -> tuple[int, int]:
    """``(max batch rows a step can have, max_model_len)``."""
    sched = vllm_config.scheduler_config
    cc = vllm_config.compilation_config
    rows = max(int(sched.max_num_seqs), int(getattr(cc, "max_cudagraph_capture_size", 0) or 0))
    return rows, int(vllm_config.model_config.max_model_len)


def block_table_width(vllm_config, page_size: int) -> int:
    """Kernel blocks of ``page_size`` tokens in a row of vLLM's block table (the width the plans
    are made for): ``ceil(max_model_len / block_size) * block_size / page_size``."""
    bs = int(vllm_config.cache_config.block_size or page_size)
    max_len = int(vllm_config.model_config.max_model_len)
    return num_pages(max_len, bs) * max(bs // page_size, 1)


def check_engine(vllm_config) -> None:
    """Engine features the LOCKS builder does not support: a ValueError naming the setting."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError("kvlocks LOCKS backend: speculative decoding is not supported (decode rows of more "
                         "than one query token); unset KVLOCKS_VLLM_CONFIG or speculative_config")
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) > 1:
            raise ValueError(f"kvlocks LOCKS backend: {name}={getattr(pc, name)} is not supported (allowed: 1)")
