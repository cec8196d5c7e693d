"""Hugging Face transformers integration: a paged LOCKS cache and an attention function.

Usage::

    model, tok = kvlocks.models.load("smollm2-135m")        # registers and enables "kvlocks"
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=256))
    model.generate(**inputs, **cache_kwargs(model, cache))

The attention function takes the LOCKS path only for single-token decode steps whose keys come
from a :class:`LocksCache` with a sparse method; everything else (prefill, other caches) runs
transformers' SDPA unchanged. Nothing is registered at import time: :func:`register` does it.

Modules: :mod:`.cache` (``LocksCache``, its layers, the decode step's backends), :mod:`.attention`
(the ``"kvlocks"`` attention function, :func:`register`, :func:`enable`, :func:`cache_kwargs`),
:mod:`.cpu` (the CPU decode step), :mod:`.decode` (prefill, decode steps, greedy answers),
:mod:`.window` (sliding-window layers of hybrid models), :mod:`.sdpa` (dense attention),
:mod:`.stats` (bytes-read accounting).
"""

from kvlocks.integrations.hf.attention import ATTN_NAME, cache_kwargs, enable, kvlocks_attention, register
from kvlocks.integrations.hf.cache import (DEFAULT_RERANK, METHODS, LocksCache, LocksLayer, kernel_path,
                                           method_names)

__all__ = ["ATTN_NAME", "DEFAULT_RERANK", "METHODS", "LocksCache", "LocksLayer", "cache_kwargs", "enable",
           "kernel_path", "kvlocks_attention", "method_names", "register"]
