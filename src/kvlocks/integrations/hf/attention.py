"""The ``"kvlocks"`` attention function (a LocksCache layer's decode step, else SDPA) and its switches."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

ATTN_NAME = "kvlocks"


def kvlocks_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention function registered as ``"kvlocks"`` in transformers' ``AttentionInterface``."""
    from kvlocks.integrations.hf.sdpa import dense_attention

    layer = getattr(key, "_kvlocks_layer", None)
    if layer is not None and query.shape[2] == 1:
        if layer.sparse:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return layer.decode(query, key, value, attention_mask, scale), None
        layer.count_dense(key)  # full on a global layer, or a sliding layer's window
    return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register() -> None:
    """Register the ``"kvlocks"`` attention (and its SDPA-style mask). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvlocks_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def enable(model) -> None:
    """Switch a loaded model's attention to ``"kvlocks"`` (SDPA unless a LOCKS cache is used)."""
    register()
    model.set_attn_implementation(ATTN_NAME)


def cache_kwargs(model, cache: Cache) -> dict:
    """The keyword ``generate``/``forward`` take the cache under (``cache`` in new transformers)."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
