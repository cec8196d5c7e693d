"""Learned attention sinks (gpt-oss) in LOCKS's softmax, exactly.

A sink layer adds one learned logit ``sink[h]`` per query head to the softmax's denominator, with
no value: ``out = sum_j exp(l_j) v_j / (sum_j exp(l_j) + exp(sink[h]))``. Sparse (or dense)
attention without the sink gives ``out0 = sum_j exp(l_j) v_j / exp(lse)`` and ``lse``, so

    out = out0 * exp(lse) / (exp(lse) + exp(sink)) = out0 * sigmoid(lse - sink)

exactly, in float32. Applied to every row kvlocks attends on a global (non-window) sink layer;
window layers run vLLM's attention, which applies the sink itself.
"""

from __future__ import annotations

import torch


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``sigmoid(lse - sink)``: float32 ``[B, Hq]`` from ``lse [B, Hq]`` (natural log) and ``sinks [Hq]``."""
    return torch.sigmoid(lse.float() - sinks.float())


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Scale ``out [B, Hq, D]`` in place by :func:`sink_factor` (computed in float32); returns ``out``."""
    out.copy_(out.float() * sink_factor(lse, sinks).unsqueeze(-1))
    return out
