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
The dense baseline's split-KV attention and merge are the same kernels and get the same launches.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

# Off until timed side by side on the H200 (scripts/device/select_ab.py --modes pdl,defaults11).
ENABLED = os.environ.get("KVLOCKS_PDL", "0") == "1"


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled(device) -> bool:
    """Whether launches on ``device`` use PDL: ``ENABLED``, a CUDA device of compute capability >= 9.0."""
    device = torch.device(device)
    if not ENABLED or device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)
