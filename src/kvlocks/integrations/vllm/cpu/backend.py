"""The LOCKS attention backend for vLLM on CPU: the stock ``CPU_ATTN`` backend plus sparse decode.

Everything except single-token decode runs vLLM's stock CPU kernels unchanged (prefill, chunked
prefill, encoder attention, the cache writes). For each request whose query at this step is one
token (a decode step), the LOCKS path:

1. makes sure every full 16-token page of the sequence has a valid summary in the layer's
   :class:`~kvlocks.integrations.vllm.cpu.store.BlockSummaryStore` (building, from the paged cache,
   the pages that filled since the last step, at the end of prefill, or whose block was reused);
2. runs :class:`~kvlocks.plan.DecodePlan` for the batch's decode rows over the paged cache
   (:func:`~kvlocks.integrations.vllm.cpu.store.decode_rows`; flat, ``rerank``, centroid scores):
   scores, selects sink + recent + top pages, and attends their full K/V only.

A request whose pages all fit in the budget gets dense attention, which is what LOCKS selects
then; it is left to the stock kernel. In a mixed batch (some requests prefilling), the stock
kernel runs for the whole batch and the decode rows that need LOCKS are then overwritten, so a
request's tokens do not depend on what it was batched with.

Debug environment variables (read in the worker): ``KVLOCKS_VLLM_TRACE=path`` appends one JSON
line per (layer, decode request) with the selected pages; ``KVLOCKS_VLLM_VERIFY=1`` checks that
every summary used was built from the keys now in its page (``stale`` in the trace);
``KVLOCKS_VLLM_IGNORE_TAGS=1`` disables the validity tags (a negative control for tests).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from kvlocks import env
from kvlocks.integrations.vllm import compat, startup
from kvlocks.integrations.vllm import layers as layer_table
from kvlocks.integrations.vllm.plugin import current_config, current_settings
from kvlocks.integrations.vllm.settings import resolve_dense_below
from kvlocks.integrations.vllm.cpu.store import BlockSummaryStore, PagedBlocks, decode_rows
from kvlocks.plan import sparse_rows

log = logging.getLogger(__name__)

_StockBackend, _StockImpl = compat.stock_cpu_classes()


class LocksCPUAttentionImpl(_StockImpl):
    """vLLM's CPU attention implementation with LOCKS single-token decode."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.locks = current_config()
        self.store: BlockSummaryStore | None = None
        self._store_key = None
        self.layout: str | None = None  # probed at the first LOCKS step
        self._seen_real_write = False
        self.trace_path = env.get("KVLOCKS_VLLM_TRACE")
        self.verify = env.flag("KVLOCKS_VLLM_VERIFY")
        self.ignore_tags = env.flag("KVLOCKS_VLLM_IGNORE_TAGS")
        self.kvlocks_decision = None  # read by the layer table (layers.py)
        self._dense_tokens: int | None = None
        self._vllm_config = compat.current_vllm_config()
        if self.locks is not None:
            self._check_engine()
            self.kvlocks_decision = layer_table.decide(self._facts(), head_dims=range(2, 4097, 2), sinks_supported=True,
                                                       dense="CPU attention")
            if self.kvlocks_decision.outcome != layer_table.LOCKS:
                self.locks = None

    def _check_engine(self) -> None:
        mc = getattr(self._vllm_config, "model_config", None)
        cc = getattr(self._vllm_config, "cache_config", None)
        startup.check(self.locks, platform="cpu", dtype=getattr(mc, "dtype", None), kv_cache_dtype=self.kv_cache_dtype,
                      block_size=getattr(cc, "block_size", None))

    def _facts(self) -> layer_table.LayerFacts:
        return layer_table.LayerFacts(
            attn_type=self.attn_type, sliding_window=self.sliding_window,
            alibi=self.alibi_slopes is not None, soft_cap=self.logits_soft_cap or None,
            sinks=getattr(self, "sinks", None) is not None, head_size=self.head_size,
            kv_shared_with=getattr(self, "kv_sharing_target_layer_name", None))

    def _report_layers(self) -> None:
        """Once per model, at its first forward pass (every layer is built by then): the table."""
        if self._vllm_config is None or layer_table.reported(id(self._vllm_config)):
            return
        layers = compat.model_attention_layers(self._vllm_config)
        decisions = layer_table.model_decisions(layers, dense="CPU attention")
        layer_table.report(decisions, strict=current_settings().strict, key=id(self._vllm_config))

    # ------------------------------------------------------------ cache writes: validity tags

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.locks is not None:
            self._store_for(kv_cache).note_writes(slot_mapping)

    def _store_for(self, kv_cache: torch.Tensor) -> BlockSummaryStore:
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._store_key != key:  # first use, or vLLM re-allocated its cache: nothing is valid
            nb, _, bs, _ = kv_cache.shape
            self.store = BlockSummaryStore(self.locks, nb, bs, self.num_kv_heads, self.head_size, verify=self.verify,
                                           ignore_tags=self.ignore_tags)
            self._store_key = key
            log.info("kvlocks: LOCKS summaries for %d blocks x %d pages: %.1f MiB per layer",
                     nb, self.store.pages_per_block, self.store.nbytes() / 2**20)
        return self.store

    # ------------------------------------------------------------ attention

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if self.kvlocks_decision is not None:  # configured (this layer may still fall back)
            self._report_layers()
        if self.locks is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        step = compat.step_view(attn_metadata)
        qlen = step.query_start_loc[1:] - step.query_start_loc[:-1]  # [R]
        sparse = sparse_rows(qlen, step.seq_lens, page_size=self.locks.page_size, k=self.locks.pages_per_step,
                             dense_below=self._dense_below()) & step.causal  # [R]
        if not bool(sparse.all()):
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                            output_scale, output_block_scale)
        rows = sparse.nonzero().flatten().tolist()
        if rows:
            self._locks_decode(layer, query, key, kv_cache, step, rows, output)
        return output

    def _dense_below(self) -> int:
        """Tokens up to which a step's decode rows (all rows together) attend with vLLM's CPU attention
        (``"dense_below"``)."""
        if self._dense_tokens is None:
            self._dense_tokens = resolve_dense_below(current_settings().dense_below, cuda=False,
                                                     num_kv_heads=self.num_kv_heads, head_dim=self.head_size)
        return self._dense_tokens

    def _locks_decode(self, layer, query, key, kv_cache, step, rows, output) -> None:
        """LOCKS attention for the decode requests ``rows``; writes ``output [T, Hq, D]``."""
        if self.layout is None:
            self.layout = compat.probe_cache_layout(compat.layer_isa(layer), kv_cache.dtype, self.num_kv_heads,
                                                    kv_cache.shape[2], self.head_size)
        store = self._store_for(kv_cache)
        key_cache, value_cache = compat.split_kv_cache(kv_cache, self.num_kv_heads, self.head_size, self.layout)
        if not self._seen_real_write and key is not None:
            self._check_real_write(key, key_cache, step, rows[0])
        tok, s = step.query_start_loc[rows], self.locks.page_size  # [R'] each row's query token
        q = query[tok].view(len(rows), self.num_heads, self.head_size)  # [R', Hq, D]
        out, pages, built, stale = decode_rows(store, PagedBlocks(key_cache, s), PagedBlocks(value_cache, s), q,
            step.block_table[rows], step.seq_lens[rows], scale=self.scale, sinks=self.sinks, verify=self.verify)
        output[tok] = out.view(output[tok].shape).to(output.dtype)
        for i, r in enumerate(rows if self.trace_path else ()):
            self._trace(compat.layer_index(layer), int(step.seq_lens[r]), step.block_table[r, 0], pages[i], built[i],
                        None if stale is None else stale[i])

    def _check_real_write(self, key, key_cache, step, r) -> None:
        """Once per layer: this step's key of request ``r`` must read back from the real cache."""
        n, t, bs = int(step.seq_lens[r]), int(step.query_start_loc[r]), key_cache.shape[2]
        got = key_cache[step.block_table[r, (n - 1) // bs], :, (n - 1) % bs]  # [Hkv, D]
        if not torch.equal(got, key[t].to(got.dtype)):
            raise compat.VllmCompatError(
                f"kvlocks: the key written for position {n - 1} does not read back from the paged cache "
                f"at block {int(step.block_table[r, (n - 1) // bs])}, row {(n - 1) % bs} "
                f"(layout {self.layout!r}); refusing to read this cache")
        self._seen_real_write = True

    def _trace(self, lidx, n, block0, pages, built, stale) -> None:
        rec = {"pid": os.getpid(), "layer": lidx, "seq_len": n, "block0": int(block0),
               "pages": pages.tolist(), "built": built, "stale": stale}
        with open(self.trace_path, "a") as f:
            f.write(json.dumps(rec) + "\n")


class LocksCPUMetadataBuilder(_StockBackend.get_builder_cls()):
    """vLLM's CPU metadata builder; made when vLLM sets up its KV cache (engine start, every layer
    built): the layer table is logged then (strict mode: an error), before any request."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, *args, **kwargs)
        if current_config() is not None and not layer_table.reported(id(vllm_config)):
            layers = compat.model_attention_layers(vllm_config)
            layer_table.report(layer_table.model_decisions(layers, dense="CPU attention"),
                               strict=current_settings().strict, key=id(vllm_config))


class LocksCPUAttentionBackend(_StockBackend):
    """vLLM's ``CPU_ATTN`` backend with the LOCKS implementation and builder (same name and layout)."""

    @staticmethod
    def get_impl_cls():
        return LocksCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return LocksCPUMetadataBuilder
