"""Programmatic dependent launch (PDL) for the decode step's chain of short kernels.

On Hopper and later, a kernel launched with the programmatic-stream-serialization attribute may be
scheduled before the kernel ahead of it in the stream has finished: as soon as every block of that
kernel has executed ``griddepcontrol.launch_dependents`` (or exited). The dependent kernel's first
instruction is ``griddepcontrol.wait``, which returns once the kernels it depends on have completed
and their memory is visible, so what it computes does not change; what overlaps is its launch and
block scheduling with the tail of the kernel ahead.

The LOCKS step is a chain of short, latency-bound kernels per layer (score, fused selection, split-KV
attention, merge) where each launch boundary costs a few microseconds at short context. With
``ENABLED``, the score kernel (``score_mma.cu``) and every Triton kernel of the chain trigger their
dependents right after their own wait, and the selection, attention and merge launches carry the
attribute. Every kernel launched with it waits before reading anything, and triggers only after its
own wait, so a kernel that starts early never reads what an earlier kernel has not finished writing.
(Session 20 timed the score kernel reading its summaries before that wait on steps that build none:
no gain, removed; commit d6cdcc2 has it.)
The dense baseline's split-KV attention and merge are the same kernels and get the same launches.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

# On (``KVLOCKS_PDL=0`` turns it off). H200, GLM-4-9B shape, batch 1, whole-model TPOT, modes
# interleaved on one machine (session 18, scripts/device/select_ab.py --modes defaults11,pdl,...;
# docs/results/gpu_session18/call2/): 32K LOCKS 7.004 / 6.860 -> 6.578 / 6.603 ms, dense 6.729 / 6.713
# -> 6.536 / 6.571; 1M LOCKS 11.142 -> 10.837. Same pages, outputs and tokens (GPU tests).
def _from_env() -> bool:
    value = os.environ.get("KVLOCKS_PDL", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"KVLOCKS_PDL={value!r}: allowed '1' (programmatic dependent launch on, the default) or '0'")
    return value == "1"


ENABLED = _from_env()


def enabled(device) -> bool:
    """Whether launches on ``device`` use PDL: ``ENABLED``, a CUDA device of compute capability >= 9.0
    and a Triton with the grid-dependency intrinsics. Called at every launch: cached per device."""
    if not ENABLED:
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
