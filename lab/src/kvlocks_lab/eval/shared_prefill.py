"""One record's shared dense prefill, and a cache for every method x budget decoded from it.

Every method sees the identical prefill: selectors and ``full`` decode from a fork of one
:class:`~kvlocks.integrations.hf.LocksCache` (summaries built once at the end of the prefill);
compaction methods decode from a plain transformers cache holding the compacted context
(:mod:`kvlocks_lab.eval.compacted`). The prediction after the context is the dense prefill's for
every method; from the first decode step on, each method's own cache is used.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks_lab.eval.compacted import RecordCompactions, compacted_selector_stats, compaction_stats
from kvlocks.integrations.hf.decode import prefill
from kvlocks_lab.eval.methods import MethodSpec
from kvlocks.integrations.hf import LocksCache


def fork_cache(cache):
    """An independent copy of ``cache`` to decode on (LOCKS caches fork; others deep-copy)."""
    fork = getattr(cache, "fork", None)
    return fork() if callable(fork) else copy.deepcopy(cache)


@dataclass
class Opened:
    """A method's cache, ready for the first decode step after the context.

    ``stats()`` gives the bytes-read accounting (DecodeStats' keys); ``fields`` are extra row
    fields (compaction: ratio, kept entries, fit time); ``context`` must be entered around
    every forward on the cache (the bias-aware attention for ``am``/``rank1``).
    """

    cache: object
    stats: Callable[[], dict]
    fields: dict = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class SharedPrefill:
    """Prefill ``prefix_ids`` once (dense, LOCKS summaries built) and open methods from it.

    Parameters
    ----------
    model
    prefix_ids : list of int
    base : LocksConfig
        Summary settings; ``budget`` is replaced per method and budget.
    budgets : sequence of int
        Budgets of the run (the prefill cache is built with the largest).
    compactions : RecordCompactions or None
        Needed only when compaction methods are opened.
    """

    def __init__(self, model, prefix_ids: list[int], base: LocksConfig, budgets, *,
                 compactions: RecordCompactions | None = None) -> None:
        self.model, self.base, self.budgets, self.compactions = model, base, tuple(budgets), compactions
        t0 = time.perf_counter()
        self.cache = LocksCache(model.config, method="locks", config=base.replace(budget=max(self.budgets)))
        self.logits = prefill(model, self.cache, torch.tensor([prefix_ids], device=model.device))  # [V]
        self.prefill_s = time.perf_counter() - t0

    def open(self, spec: MethodSpec, budget: int | None) -> Opened:
        if spec.kind != "compaction":
            config = self.base.replace(budget=budget or max(self.budgets))
            cache = self.cache.fork(method=spec.base, config=method_config(spec.base, config)
                                    if isinstance(spec.base, str) else config)
            return Opened(cache=cache, stats=cache.stats.summary)
        if self.compactions is None:
            raise ValueError(f"method {spec.name!r} needs compaction settings (RecordCompactions)")
        from kvlocks.integrations.hf.compaction import attention, serve

        prefix = self.compactions.get(spec.base, spec.ratio)
        model = self.model
        elem = torch.finfo(model.dtype).bits // 8
        fields = {"ratio": spec.ratio, "compaction": spec.base, "kept": prefix.kept,
                  "prefix_tokens": prefix.prefix_len, "compact_s": prefix.compact_seconds}
        if spec.selector is not None:  # sparse decode over the compacted (plain) cache
            cache = serve.to_locks_cache(model, prefix, method=spec.selector,
                                         config=self.base.replace(budget=budget or max(self.budgets)))
            return Opened(cache=cache, stats=lambda: compacted_selector_stats(cache, prefix, elem), fields=fields)
        with attention.using(model):  # to_cache switches biased prefixes' attention: undo it after
            cache = serve.to_cache(model, prefix)
        ctx = (lambda: attention.using(model)) if prefix.has_bias else contextlib.nullcontext
        return Opened(cache=cache, stats=lambda: compaction_stats(cache, prefix, elem), fields=fields, context=ctx)
