"""Programmatic dependent launch (PDL) for the decode step's chain of short kernels.

On Hopper and later, a kernel launched with the programmatic-stream-serialization attribute may be
scheduled before the kernel ahead of it in the stream has finished: as soon as every block of that
kernel has executed ``griddepcontrol.launch_dependents`` (or exited). The dependent kernel's first
instruction is ``griddepcontrol.wait``, which returns once the kernels it depends on have completed
and their memory is visible, so what it computes does not change; what overlaps is its launch and
block scheduling with the tail of the kernel ahead.

The LOCKS step is a chain of short, latency-bound kernels per layer (score, fused selection, split-KV
attention, merge) where each launch boundary costs a few microseconds at short context. With
``KernelOptions.pdl`` (default on; ``KVLOCKS_PDL=0`` turns the default off), the score kernel
(``score_mma.cu``) and every Triton kernel of the chain are launched with the attribute and trigger
their dependents right after their own wait. Every kernel launched with it waits before reading
anything, and triggers only after its own wait, so a kernel that starts early never reads what an
earlier kernel has not finished writing. The dense baseline's split-KV attention and merge are the
same kernels and get the same launches.

H200, GLM-4-9B shape, batch 1, whole-model TPOT, modes interleaved on one machine
(docs/benchmarks.md): 32K LOCKS 7.004 / 6.860 -> 6.578 / 6.603 ms, dense 6.729 / 6.713 -> 6.536 /
6.571; 1M LOCKS 11.142 -> 10.837. Same pages, outputs and tokens (GPU tests). Reading the summaries
before the score kernel's wait, on steps that build none, was timed too: no gain (LOCKS 32K 6.324 /
6.358 vs 6.336 / 6.469 ms).
"""

from __future__ import annotations

from functools import lru_cache

import torch


def enabled(device, on: bool) -> bool:
    """Whether launches on ``device`` use PDL: ``on`` (``KernelOptions.pdl``), a CUDA device of
    compute capability >= 9.0 and a Triton with the grid-dependency intrinsics. Called at every
    launch: cached per device."""
    if not on:
        return False
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) >= (9, 0) and _triton_has_gdc()


@lru_cache(maxsize=None)
def _triton_has_gdc() -> bool:
    """Triton >= 3.4 has the grid-dependency intrinsics and the ``launch_pdl`` launch option."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
