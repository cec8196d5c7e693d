"""Hugging Face transformers integration: a paged LOCKS cache and an attention function.

Usage::

    model, tok = kvlocks.models.load("smollm2-135m")        # registers and enables "kvlocks"
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=256))
    model.generate(**inputs, **cache_kwargs(model, cache))

The attention function takes the LOCKS path only for single-token decode steps whose keys come
from a :class:`LocksCache` with a sparse method; everything else (prefill, other caches) runs
transformers' SDPA unchanged. Nothing is registered at import time: :func:`register` does it.
"""

from kvlocks.integrations.hf.attention import ATTN_NAME, cache_kwargs, enable, kvlocks_attention, register  # noqa: F401
from kvlocks.integrations.hf.cache import DEFAULT_RERANK, METHODS, LocksCache, LocksLayer, kernel_path, method_names  # noqa: F401

