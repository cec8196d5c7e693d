"""The ``"kvlocks_compact"`` attention function: query capture and the logit-bias serving path.

It is a strict superset of ``"kvlocks"`` (:func:`kvlocks.integrations.hf.kvlocks_attention`):
with any cache that does not ask for more, it delegates there unchanged (stock SDPA, or LOCKS
sparse decode with a LOCKS cache). Two kinds of cache ask for more, through attributes set on
the key tensor their ``update`` returns (no global state, nothing on the model):

* ``key._kvlocks_record``: a recorder; the post-RoPE queries of every call are handed to it
  (:mod:`.capture`, reference queries for compaction).
* ``key._kvlocks_bias_layer``: a cache layer whose first ``t`` entries carry a per-KV-head
  logit bias (the ``am`` and ``rank1`` methods, :mod:`.serve`). The bias becomes an additive
  float ``attn_mask`` of ``torch.nn.functional.scaled_dot_product_attention``: stock SDPA, but
  not its flash backend (which takes no float mask), and not the plain caches of other engines.

Nothing is registered at import; :func:`register` does it, :func:`enable` switches a model for
good (a superset of ``"kvlocks"``, so harmless) and :func:`using` switches it for a block.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

ATTN_NAME = "kvlocks_compact"


def bias_mask(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
              bias: torch.Tensor) -> torch.Tensor:
    """Additive float mask: causal/padding mask plus the prefix entries' logit bias.

    Parameters
    ----------
    query : Tensor [B, Hq, L, D]
    key : Tensor [B, Hkv, N, D]
        The whole cache after this step's update (N = t + tokens appended since).
    attention_mask : Tensor [B, 1 or Hq, L, N] (bool: True = attend; or float additive), or None
        None means plain causal attention, aligned bottom-right (the L queries are the last L
        of the N cache entries).
    bias : Tensor [B or 1, Hkv, t]
        Logit bias of the first t cache entries; later entries get 0.

    Returns
    -------
    Tensor [B, Hq, L, N], ``query.dtype``
    """
    b, hq, length, _ = query.shape
    hkv, num = key.shape[1], key.shape[2]
    t = bias.shape[-1]
    add = query.new_zeros((bias.shape[0], hkv, num))  # [B, Hkv, N]
    add[:, :, :t] = bias.to(query.dtype)
    add = add.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]  # [B, Hq, 1, N]
    if attention_mask is None:
        rows = torch.arange(length, device=query.device)[:, None] + (num - length)  # [L, 1]
        allowed = rows >= torch.arange(num, device=query.device)[None, :]  # [L, N]
        attention_mask = allowed[None, None]  # [1, 1, L, N]
    if attention_mask.dtype == torch.bool:
        low = torch.finfo(query.dtype).min
        return torch.where(attention_mask, add, low).expand(b, hq, length, num).contiguous()
    return (add + attention_mask.to(query.dtype)).expand(b, hq, length, num).contiguous()


def compact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):
    """Attention function registered as ``"kvlocks_compact"`` (module docstring).

    Shapes as transformers' SDPA attention: query ``[B, Hq, L, D]``, key/value
    ``[B, Hkv, N, D]``; returns ``([B, L, Hq, D], None)``.
    """
    from kvlocks.integrations.hf import kvlocks_attention
    from kvlocks.integrations.hf.sdpa import dense_attention

    recorder = getattr(key, "_kvlocks_record", None)
    if recorder is not None:
        recorder.add(module.layer_idx, query, scaling)
    layer = getattr(key, "_kvlocks_bias_layer", None)
    if layer is not None:
        layer.bias_consumed = True
        mask = bias_mask(query, key, attention_mask, layer.bias)  # [B, Hq, L, N]
        return dense_attention(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return kvlocks_attention(module, query, key, value, attention_mask, dropout=dropout,
                             scaling=scaling, **kwargs)


def register() -> None:
    """Register ``"kvlocks_compact"`` (and its SDPA-style mask) with transformers. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, compact_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def enable(model) -> None:
    """Switch ``model`` to ``"kvlocks_compact"`` (behaves as ``"kvlocks"`` with other caches)."""
    register()
    if model.config._attn_implementation != ATTN_NAME:
        logger.info("switching %s attention from %r to %r", type(model).__name__,
                    model.config._attn_implementation, ATTN_NAME)
        model.set_attn_implementation(ATTN_NAME)


@contextlib.contextmanager
def using(model):
    """Run a block with ``model`` on ``"kvlocks_compact"``, then restore its attention."""
    previous = model.config._attn_implementation
    enable(model)
    try:
        yield model
    finally:
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
