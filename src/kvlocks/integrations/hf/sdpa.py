"""Dense attention through transformers' SDPA function, kept off cuDNN's attention backend on CUDA.

PyTorch's cuDNN attention compiles an execution graph for each new set of shapes, key length
included, and keeps it for reuse. A decode step's key length grows by one, so a dense decode
(``full``, the reference passes of compaction, every call the ``"kvlocks"`` attention leaves to
SDPA) could compile one on every step. Three batched self-study passes of compaction (32 greedy
steps) took 2.3-3.7 s in bfloat16 on an H200 against 0.76 s in float32, a dtype cuDNN's backend
does not serve (``docs/results/2026-12-05-h200-compaction-speed``), and a profile of the same
passes on an H100 has every attention call on ``aten::_cudnn_attention_forward``. Here the flash,
memory-efficient and math backends stay allowed, in PyTorch's own order; on the CPU nothing
changes (cuDNN is a CUDA backend).
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def dense_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' ``sdpa_attention_forward`` (same arguments and result), without cuDNN on CUDA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not query.is_cuda:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with sdpa_kernel(list(CUDA_BACKENDS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
