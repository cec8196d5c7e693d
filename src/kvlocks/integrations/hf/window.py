"""Hybrid models in the Hugging Face cache: sliding-window layers beside the global ones.

Gemma 3 interleaves five sliding-window layers (a token attends the last ``sliding_window``
positions, itself included) with one global (``full_attention``) layer. In a
:class:`~kvlocks.integrations.hf.LocksCache`:

- a global layer is a ``LocksLayer``: paged K/V, page summaries for the selectors that read
  them, and the method's decode step (a selector's pages, or every page for ``full``);
- a sliding layer is a :class:`WindowLayer`: transformers' own ``DynamicSlidingWindowLayer``
  (it keeps the last ``sliding_window - 1`` tokens and gives the masks their sizes), so it
  computes what transformers' own cache computes, for every method. It has no summaries and no
  selector acts on it; its decode step reads its window's K/V, counted as a ``"window"`` layer
  in :class:`~kvlocks.integrations.hf.stats.DecodeStats`.

Budget semantics: ``budget`` is tokens per *global* layer and KV head; a window layer reads
``min(N, sliding_window)`` tokens at every step whatever the budget or the method.

Which layers are sliding and their windows: :func:`kvlocks.hybrid.layer_windows`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvlocks.pages import num_pages

def check_sparse(model_config, selector, method: str) -> None:
    """Refuse a selector (None: dense, always fine) where the model's attention is not plain
    softmax attention."""
    if selector is None:
        return
    cap = getattr(model_config.get_text_config(decoder=True), "attn_logit_softcapping", None)
    if cap is not None:
        raise ValueError(f"method={method!r}: the model's attn_logit_softcapping={cap} is not applied by sparse "
                         "decode (its logits would differ from the model's); use method='full'")


def check_positions(owner, stored: int, new: int) -> None:
    """``ValueError`` when ``stored + new`` tokens exceed the cache owner's ``positions`` limit."""
    limit = owner.positions
    if limit is not None and stored + new > limit:
        raise ValueError(f"the context ({stored + new} tokens) exceeds the model's {limit} positions "
                         "(max_position_embeddings): shorten the prompt or generate fewer tokens "
                         "(kvlocks.positions.check_context cuts a prompt on the side you name)")


class WindowLayer(DynamicSlidingWindowLayer):
    """One sliding-window layer of a :class:`~kvlocks.integrations.hf.LocksCache`.

    Storage, returned K/V ``[B, Hkv, n, D]`` (``n <= sliding_window`` at a decode step) and mask
    sizes are transformers' ``DynamicSlidingWindowLayer``'s; this class adds the owner, the byte
    accounting of its decode steps and :meth:`copy_from` (forks).
    """

    sparse = False  # never a selector's layer
    _layer_type = None  # not registered in transformers' layer-type mappings (importing changes nothing)

    def __init__(self, owner, layer_idx: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.owner = owner
        self.layer_idx = layer_idx

    def update(self, key_states, value_states, *args, **kwargs):
        check_positions(self.owner, self.cumulative_length, key_states.shape[-2])
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        keys._kvlocks_layer = self  # the attention function counts this layer's decode reads
        return keys, values

    def count_dense(self, key: torch.Tensor) -> None:
        """Count one decode step over ``key [B, Hkv, n, D]``: the n window tokens, all read."""
        hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
        read = 2.0 * hkv * n * d * key.element_size()
        self.owner.stats.add(self.layer_idx, kind="window", pages=num_pages(n, self.owner.config.page_size), tokens=n,
                             context=self.cumulative_length, selection_bytes=0.0, kv_bytes=read, full_bytes=read)

    def copy_from(self, src: "WindowLayer") -> None:
        """Take an independent copy of ``src``'s window (a fork of the cache)."""
        if src.is_initialized:
            self.lazy_initialization(src.keys, src.values)
            self.keys, self.values = src.keys.clone(), src.values.clone()
        self.cumulative_length = src.cumulative_length


def layer_kinds(cache) -> dict[str, list[int]]:
    """The layers of a LocksCache by kind: ``{"sparse" | "dense" | "window": [layer indices]}``."""
    kinds: dict[str, list[int]] = {}
    for i, layer in enumerate(cache.layers):
        kind = "window" if isinstance(layer, WindowLayer) else ("sparse" if cache.selector is not None else "dense")
        kinds.setdefault(kind, []).append(i)
    return kinds
