"""LOCKS's GPU memory inside vLLM's ``gpu_memory_utilization``: byte arithmetic and the reserve.

vLLM sizes its KV pool as ``requested - non-KV memory``, where non-KV memory is measured during its
profiling run (weights, peak activations, and any tensor allocated then). LOCKS's memory is counted
there:

- the decode plans (:class:`~kvlocks.integrations.vllm.cuda.step.PlanPool`, at most
  ``KVLOCKS_VLLM_PLAN_GIB``) are allocated during the profiling run, for every chunk size the
  engine's batches can use, and kept;
- the summaries scale with the pool (``rho`` = summary bytes / K/V bytes per block), which vLLM
  sizes only after profiling. So a *reserve* of ``rho / (1 + rho)`` of the memory still free
  within the share at profiling time is allocated then (an upper bound of the summaries of the pool
  vLLM will size from what is left) and released when the summaries are allocated, which then take
  at most its place. The pool shrinks by ``1 / (1 + rho)``; a full pool cannot run LOCKS out of
  memory. :func:`pool_tokens` gives the log line's figures, with and without LOCKS.

With ``kv_cache_memory_bytes`` vLLM takes the user's pool size and skips profiling: nothing is
reserved and the summaries come on top (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvlocks.config import LocksConfig
from kvlocks.summary.types import summary_bytes

log = logging.getLogger(__name__)

TAG_BYTES_PER_BLOCK = 3 * 4  # write_gen, built_gen, built_page: int32 (vllm/store.py)


def summary_bytes_per_block(config: LocksConfig, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block's summaries and tags in one layer (a block is one 16-token page)."""
    payload, scales = summary_bytes(config.page_size, config.rank, head_dim, 4, 8)  # the store's int4/int8
    return num_kv_heads * (payload + scales) + TAG_BYTES_PER_BLOCK


def kv_bytes_per_block(page_size: int, num_kv_heads: int, head_dim: int, dtype_size: int) -> int:
    """K and V bytes of one block (``page_size`` tokens) in one layer."""
    return 2 * page_size * num_kv_heads * head_dim * dtype_size


@dataclass(frozen=True)
class ModelBytes:
    """Per block of the pool: K/V bytes over every KV cache tensor, summary bytes over the LOCKS
    layers. ``kv_tensors``: layers that hold their own K/V tensor (with vLLM's hybrid manager the
    groups share tensors: one per layer of a group)."""

    kv_per_block: int  # bytes, all tensors
    summary_per_block: int  # bytes, all LOCKS layers

    @property
    def rho(self) -> float:
        return self.summary_per_block / self.kv_per_block if self.kv_per_block else 0.0


def model_bytes(config: LocksConfig, layers: list[tuple[bool, int, int, int]], *, hybrid: bool) -> ModelBytes:
    """``layers``: ``(runs_locks, Hkv, D, dtype_size)`` of every layer with a KV cache. ``hybrid``:
    the model mixes sliding-window and global layers (vLLM's hybrid manager: as many K/V tensors as
    LOCKS layers, a lower bound that over-states ``rho``, the safe side)."""
    s = config.page_size
    locks = [x for x in layers if x[0]]
    tensors = locks if (hybrid and locks) else layers
    kv = sum(kv_bytes_per_block(s, h, d, e) for _, h, d, e in tensors)
    sb = sum(summary_bytes_per_block(config, h, d) for _, h, d, _ in locks)
    return ModelBytes(kv_per_block=kv, summary_per_block=sb)


def reserve_bytes(rho: float, free_in_share: int) -> int:
    """The summaries' reserve for ``free_in_share`` bytes still free within the share: the
    summaries of a pool of ``free / (1 + rho)`` blocks' bytes."""
    if rho <= 0 or free_in_share <= 0:
        return 0
    return int(free_in_share * rho / (1.0 + rho)) + 1


def pool_tokens(num_blocks: int, page_size: int, bytes_: ModelBytes, locks_bytes: int) -> tuple[int, int]:
    """``(tokens the pool holds, tokens it would hold without LOCKS)``: without LOCKS the
    ``locks_bytes`` (summaries and plans) would be K/V blocks."""
    extra = locks_bytes // bytes_.kv_per_block if bytes_.kv_per_block else 0
    return num_blocks * page_size, (num_blocks + extra) * page_size


class Reserve:
    """The profiling-time reserve of one process (one device)."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.bytes = 0  # reserved at profiling
        self.plan_bytes = 0
        self.model: ModelBytes | None = None
        self.fixed_pool = False  # kv_cache_memory_bytes: nothing reserved, summaries on top
        self.done = False

    def take(self, nbytes: int, device) -> None:
        self.bytes = int(nbytes)
        if nbytes > 0:
            self.tensor = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        self.done = True

    def release(self) -> int:
        """Free the reserve (the summaries are about to be allocated); returns its size."""
        n = self.bytes if self.tensor is not None else 0
        if self.tensor is not None:
            self.tensor = None
            # Back to the driver, not only to torch's cache: vLLM may allocate the summaries in another
            # memory pool (its CUDA-graph pool), which a block cached here would not serve.
            if not torch.cuda.is_current_stream_capturing():
                torch.cuda.empty_cache()
        return n


RESERVE = Reserve()


def free_in_share(device, utilization: float) -> int:
    """Bytes of ``utilization`` x the device's memory not yet allocated by torch in this process."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * utilization) - torch.cuda.memory_allocated(device)
