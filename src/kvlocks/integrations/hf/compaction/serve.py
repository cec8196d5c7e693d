"""Serve a compacted prefix from a plain transformers cache, so ``model.generate`` continues it.

Positions. A compacted prefix holds t entries that stand for T tokens; kept keys keep the RoPE
phase of their original positions and new tokens must continue at position T, not t. The
caches here separate the two lengths transformers conflates:

* ``get_seq_length()`` is the *logical* length (T + tokens appended): it gives new tokens their
  ``position_ids`` (model forward, and ``generate``'s slicing of the prompt);
* ``get_query_offset()`` and the layers' ``get_mask_sizes`` use the *physical* length
  (t + tokens appended): the causal mask indexes the stored entries.

So ``generate`` is called exactly as when continuing a stock cache: ``input_ids`` hold the
whole sequence, T prefix tokens then the new ones (:func:`continuation_inputs` fills the
prefix with placeholders, which are never read: only the last L ids are fed).

Sliding-window layers of a hybrid model hold the prefix's last W - 1 tokens exactly as a stock
sliding cache does after T tokens, and count T as their length (their mask offsets are logical
positions already): the offset T - t applies to the global layers alone.

Bias. ``fold``, ``drop``, ``drop_refit`` and ``merge_fold`` caches are ordinary caches (stock
SDPA, no bias). ``am`` keeps beta, and ``rank1``'s extra coordinate is the same bias: both are
served through :mod:`.attention`, which adds beta as an additive float ``attn_mask`` to stock
``scaled_dot_product_attention`` (no custom kernel, but no flash backend and no plain-cache
engine either); :func:`to_cache` switches the model to that attention for them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvlocks.compaction.prefix import CompactedPrefix, check_model
from kvlocks.config import LocksConfig
from kvlocks.integrations.hf import LocksCache

from . import attention

logger = logging.getLogger(__name__)


class _LogicalLength:
    """Mixin: logical length for positions, physical length for masks (module docstring)."""

    position_offset = 0  # T - t, in the global layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        n = super().get_seq_length(layer_idx)
        return n + self.position_offset if n and not self.layers[layer_idx].is_sliding else n

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return super().get_seq_length(layer_idx)

    def physical_length(self, layer_idx: int | None = None) -> int:
        """Entries stored in layer ``layer_idx`` (default: the first global one): t + tokens appended."""
        if layer_idx is None:
            layer_idx = [x.is_sliding for x in self.layers].index(False)
        return super().get_seq_length(layer_idx)


def _seed_window(layer: DynamicSlidingWindowLayer, keys, values, prefix_len: int) -> DynamicSlidingWindowLayer:
    """``layer`` holding a sliding layer's last prefix tokens ``[1, Hkv, w, D]``, as after T tokens."""
    layer.update(keys, values)
    layer.cumulative_length = prefix_len
    return layer


class PrefixLayer(DynamicLayer):
    """A ``DynamicLayer`` seeded with a compacted prefix, optionally with a logit bias.

    Parameters
    ----------
    bias : Tensor [1, Hkv, t] or None
        Logit bias of the first t entries (``am``/``rank1``); batch 1 broadcasts over any
        batch (beam search, several return sequences).
    """

    def __init__(self, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bias = bias
        self.bias_consumed = True

    def seed(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the prefix ``[1, Hkv, t, D]`` keys/values."""
        super().update(keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.bias is not None and not self.bias_consumed:
            raise RuntimeError(
                "this cache carries a logit bias that the previous forward did not apply: run the "
                f"model with attention {attention.ATTN_NAME!r} (kvlocks.integrations.hf.compaction.serve.to_cache "
                "switches it, or call kvlocks.integrations.hf.compaction.attention.enable(model))")
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.bias is not None:
            self.bias_consumed = False
            keys._kvlocks_bias_layer = self
        return keys, values


class CompactedCache(_LogicalLength, DynamicCache):
    """A ``DynamicCache`` holding a compacted prefix; new tokens continue at position T.

    Build it with :func:`to_cache`. Attributes: ``prefix_len`` (T), ``kept`` (t),
    ``compaction`` (the method), ``position_offset`` (T - t).
    """

    def __init__(self, prefix: CompactedPrefix, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.layer_class_to_replicate = None  # every layer is built here, seeded
        self.layers = []
        windows = prefix.windows or (None,) * prefix.model.num_layers
        for i, w in enumerate(windows):
            k, v, b = (x[None].to(device=device, dtype=dtype) if x is not None else None
                       for x in prefix.serving_layer(i))
            if w is not None:  # exact window: no bias
                self.layers.append(_seed_window(DynamicSlidingWindowLayer(w), k, v, prefix.prefix_len))
                continue
            layer = PrefixLayer(b)
            layer.seed(k, v)
            self.layers.append(layer)
        self.prefix_len, self.kept, self.compaction = prefix.prefix_len, prefix.kept, prefix.method
        self.position_offset = prefix.prefix_len - prefix.kept


class CompactedLocksCache(_LogicalLength, LocksCache):
    """A :class:`~kvlocks.integrations.hf.LocksCache` seeded with a compacted prefix.

    LOCKS summarises the prefix's pages like any other keys: a folded cache is an ordinary
    cache. New tokens continue at position T. Build it with :func:`to_locks_cache`.
    Attributes as :class:`CompactedCache` (``method`` stays the LOCKS method).
    """

    def __init__(self, model_config, prefix: CompactedPrefix, *, method: str,
                 config: LocksConfig | None, dtype: torch.dtype, device) -> None:
        super().__init__(model_config, method=method, config=config)
        for i, layer in enumerate(self.layers):
            k, v, _ = prefix.serving_layer(i)
            k, v = k[None].to(device=device, dtype=dtype), v[None].to(device=device, dtype=dtype)
            _seed_window(layer, k, v, prefix.prefix_len) if layer.is_sliding else layer.update(k, v)
        self.prefix_len, self.kept, self.compaction = prefix.prefix_len, prefix.kept, prefix.method
        self.position_offset = prefix.prefix_len - prefix.kept

    def _fork_state(self, new: "CompactedLocksCache") -> None:
        """A fork (:meth:`LocksCache.fork`) still continues at position T. (Before this hook a fork
        was a plain ``LocksCache`` reporting t + n as the next position: ``kvlocks eval`` forks at the
        first divergence from full's answer and teacher-forces the fork, so every later token got
        a position T - t too small and fold+LOCKS's KL was wrong; docs/compaction.md.)"""
        new.prefix_len, new.kept, new.compaction = self.prefix_len, self.kept, self.compaction
        new.position_offset = self.position_offset


def to_cache(model, prefix: CompactedPrefix) -> CompactedCache:
    """A :class:`CompactedCache` for ``model`` (switches it to ``"kvlocks_compact"`` if biased)."""
    check_model(prefix.model, model)
    if prefix.has_bias:
        attention.enable(model)
    logger.info("serving a %s prefix: T=%d tokens as t=%d entries per layer and KV head",
                prefix.method, prefix.prefix_len, prefix.kept)
    return CompactedCache(prefix, dtype=model.dtype, device=model.device)


def to_locks_cache(model, prefix: CompactedPrefix, *, method: str = "locks",
                   config: LocksConfig | None = None) -> CompactedLocksCache:
    """A :class:`CompactedLocksCache` (LOCKS selection over a plain compacted prefix).

    Raises
    ------
    ValueError
        For ``am``/``rank1`` prefixes: LOCKS reads a plain cache and has no bias input.
    """
    check_model(prefix.model, model)
    if prefix.has_bias:
        raise ValueError(
            f"a {prefix.method!r} cache keeps a logit bias that LOCKS decode cannot apply; serve "
            "it with to_cache (dense SDPA with the bias as attn_mask), or compact with a plain-cache "
            "method ('fold', 'drop', 'drop_refit', 'merge_fold')")
    logger.info("serving a %s prefix with %s decode: T=%d tokens as t=%d entries", prefix.method,
                method, prefix.prefix_len, prefix.kept)
    return CompactedLocksCache(model.config, prefix, method=method, config=config,
                               dtype=model.dtype, device=model.device)


def open_cache(model, path: str | Path, *, method: str = "full",
               config: LocksConfig | None = None):
    """Load and validate a compacted-cache file and build the cache to generate with.

    ``method="full"`` with a biased (``am``/``rank1``) file gives a :class:`CompactedCache`;
    otherwise a :class:`CompactedLocksCache` with ``method`` (dense ``"full"`` or a selector).
    """
    from kvlocks.compaction.cachefile import load

    prefix = load(path, model)
    if prefix.has_bias:
        if method != "full":
            raise ValueError(
                f"method={method!r}: the file holds a {prefix.method!r} cache, whose logit bias "
                "needs dense attention; use method 'full', or compact with --method fold")
        return to_cache(model, prefix)
    return to_locks_cache(model, prefix, method=method, config=config)


def continuation_inputs(cache, new_ids: torch.Tensor, *, placeholder: int = 0) -> dict:
    """``generate`` inputs after a compacted prefix: ``input_ids`` and ``attention_mask`` [1, T+L].

    ``input_ids`` are T placeholder ids, then ``new_ids`` [1, L]. Only the last L are fed to
    the model (``generate`` slices by the cache's logical length); the placeholders stand for
    the compacted prefix and are never read. The all-ones mask is explicit so that
    ``generate`` never infers padding from a placeholder that happens to be the pad token
    (positions T.. come from it; ``generate`` then drops it).
    """
    if new_ids.dim() != 2 or new_ids.shape[0] != 1 or new_ids.shape[1] < 1:
        raise ValueError(f"new_ids must have shape [1, L] with L >= 1, got {tuple(new_ids.shape)}")
    num = cache.prefix_len
    head = torch.full((1, num), placeholder, dtype=new_ids.dtype, device=new_ids.device)
    ids = torch.cat([head, new_ids], dim=1)  # [1, T+L]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, cache, new_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model.generate`` after a compacted prefix; returns only the generated ids [1, n].

    ``kwargs`` go to ``generate`` (``max_new_tokens``, ``do_sample``, ...). The cache is
    passed under the keyword the model takes.
    """
    from kvlocks.integrations.hf import cache_kwargs

    inputs = continuation_inputs(cache, new_ids.to(model.device))
    out = model.generate(**inputs, **kwargs, **cache_kwargs(model, cache))
    return out[:, inputs["input_ids"].shape[1]:]
