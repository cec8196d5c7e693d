"""The LOCKS attention backend for vLLM on CUDA: vLLM's ``FLASH_ATTN`` backend plus sparse decode.

What runs where, per attention layer and step:

- the metadata builder (:class:`LocksFlashAttentionMetadataBuilder`, on the host, every step, also
  before each CUDA-graph replay) marks the *LOCKS rows* (one query token, pages beyond the budget;
  :func:`~kvlocks.integrations.vllm.cuda.step.step_lens`) in persistent device buffers, gives
  FlashAttention those rows' key length as one token, binds each layer's summary store to its KV
  cache and prepares the plans the batch needs;
- ``do_kv_cache_update``: vLLM's cache write, then the pages written get a new write generation;
- ``forward``: a batch of single-token decodes (what vLLM's full CUDA graphs run) is attended by
  kvlocks alone: the page each new token filled is built (and, outside a graph, every full page
  whose summary is missing or stale), then score -> select -> attend
  (:class:`~kvlocks.plan.DecodePlan`) over vLLM's block table for every row, written into the
  output: LOCKS rows over their selected pages, rows that fit the budget over all their pages
  (exact attention). Any other batch (prefill, chunked prefill, prefill mixed with decodes) runs
  vLLM's FlashAttention for every row, exactly stock, then the LOCKS rows are attended by kvlocks
  and overwritten.

CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE``. Batches of single-token decodes run in vLLM's full
CUDA graphs (FlashAttention's own FA3 support is ``ALWAYS``; with this backend mixed batches run in
piecewise graphs, attention eagerly between them, as in vLLM's default FULL_AND_PIECEWISE mode).
The captured path does no host sync and (debug checks off) allocates nothing: fixed-grid kernels
over buffers made before capture (stores in the builder, plans per batch size in
:class:`~kvlocks.integrations.vllm.cuda.step.PlanPool`); vLLM's eager warm-up run of each batch size
runs the same launches first, so Triton compiles and autotunes outside capture.

Blocks: the backend asks vLLM for kernel blocks of ``page_size`` (16) tokens; any
``block_size`` that is a multiple of 16 works (vLLM splits its blocks into kernel blocks).

Debug (worker environment): ``KVLOCKS_VLLM_CHECK=1`` counts tag mismatches of the pages every
LOCKS row uses; ``KVLOCKS_VLLM_VERIFY=1`` also hashes each summary's keys at build and compares at
use (stale summaries used); ``KVLOCKS_VLLM_IGNORE_TAGS=1`` trusts any built summary (negative
control); ``KVLOCKS_VLLM_TRACE=path`` appends the selected pages of eager steps.
:func:`debug_counters` sums the counters of this process's layers.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref

import torch

from kvlocks import env
from kvlocks.integrations.vllm import layers as layer_table
from kvlocks.integrations.vllm import startup
from kvlocks.integrations.vllm.compat import current_vllm_config, layer_number, model_attention_layers
from kvlocks.integrations.vllm.cuda import compat as cuda_compat
from kvlocks.integrations.vllm.cuda import memory
from kvlocks.integrations.vllm.cuda.step import LocksDecoder, LocksStep, PlanPool, step_lens
from kvlocks.integrations.vllm.cuda.store import COUNTERS
from kvlocks.integrations.vllm.plugin import current_config, current_settings
from kvlocks.integrations.vllm.settings import resolve_dense_below
from kvlocks.kernels_support import KERNEL_HEAD_DIMS, KERNEL_PAGE_SIZE

log = logging.getLogger(__name__)
startup_log = layer_table.log  # the table's logger (shown by vLLM's default logging configuration)

_StockBackend, _StockImpl, _StockBuilder = cuda_compat.stock_flash_classes()
STEP_ATTR = "kvlocks_step"  # the LocksStep attached to FlashAttention's metadata
_POOL = PlanPool()
_DECODERS: list = []  # weak references, for debug_counters()


def debug_counters() -> dict:
    """Counters summed over this process's LOCKS layers (one device sync): ``tag_mismatches``,
    ``stale_used`` (with verification), ``pages_checked``, ``locks_rows`` (rows x layers), counted
    while ``KVLOCKS_VLLM_CHECK`` or ``KVLOCKS_VLLM_VERIFY`` is set; ``eager_builds`` (pages built
    outside a graph; a page two rows share counts once per row there) and ``eager_steps`` (layer
    forwards of decode rows outside a CUDA graph: uniform decode, or a mixed batch with LOCKS rows)
    always."""
    total = dict.fromkeys(COUNTERS, 0)
    total["eager_builds"], total["eager_steps"], total["layers"] = 0, 0, 0
    for ref in _DECODERS:
        dec = ref()
        if dec is None or dec.store is None:
            continue
        for name, v in zip(COUNTERS, dec.store.counters.tolist()):
            total[name] += int(v)
        total["eager_builds"] += dec.store.builds + int(dec.store.async_builds)
        total["eager_steps"] += dec.eager_steps
        total["layers"] += 1
    return total


def _write_counters(path: str) -> None:
    """The debug counters as JSON (``KVLOCKS_VLLM_COUNTERS``), for a serving test that cannot read
    them from inside the engine process: every ``COUNTERS_EVERY_S`` seconds from the metadata
    builder (an engine process stopped by a signal may never reach its exit handlers) and at exit."""
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), **debug_counters()}, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - at interpreter exit the device may be gone; say so
        log.exception("kvlocks: could not write the debug counters to %s", path)


COUNTERS_PATH = f"{env.get('KVLOCKS_VLLM_COUNTERS')}.{os.getpid()}" if env.get("KVLOCKS_VLLM_COUNTERS") else None
COUNTERS_EVERY_S = 5.0
_counters_written = [0.0]
if COUNTERS_PATH:
    atexit.register(_write_counters, COUNTERS_PATH)


def _maybe_write_counters() -> None:
    """From the builder, outside graph capture: the counters file when ``COUNTERS_EVERY_S`` passed
    (one device sync; only with ``KVLOCKS_VLLM_COUNTERS`` set)."""
    if not COUNTERS_PATH:  # the usual case: nothing on the builder's per-step path
        return
    now = time.monotonic()
    if now - _counters_written[0] >= COUNTERS_EVERY_S and not cuda_compat.is_capturing():
        _counters_written[0] = now
        _write_counters(COUNTERS_PATH)


_DENSE_LOGGED: set = set()


def dense_below_for(num_kv_heads: int, head_dim: int) -> int:
    """Tokens up to which a decode step (all its rows together) of this head shape attends densely
    (the plugin's ``"dense_below"`` setting,
    :func:`~kvlocks.integrations.vllm.settings.resolve_dense_below`); said once per shape in the
    startup log."""
    setting = current_settings().dense_below
    tokens = resolve_dense_below(setting, cuda=True, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if (num_kv_heads, head_dim, tokens) not in _DENSE_LOGGED:
        _DENSE_LOGGED.add((num_kv_heads, head_dim, tokens))
        startup_log.info("kvlocks: decode steps of up to %d tokens (all rows together) attend every page "
                         "(dense_below=%s; %d KV heads of %d)", tokens, json.dumps(setting), num_kv_heads, head_dim)
    return tokens


def report_layers(vllm_config) -> dict:
    """Log the model's layer table once (strict mode: raise on a fallback); returns the decisions."""
    layers = model_attention_layers(vllm_config)
    decisions = layer_table.model_decisions(layers, dense="FlashAttention")
    layer_table.report(decisions, strict=current_settings().strict, key=id(vllm_config))
    return decisions


def _at_profiling(vllm_config, query: torch.Tensor) -> None:
    """Once, in vLLM's profiling run (cuda/memory.py): log the layer table, allocate every decode
    plan the engine's batches can use and reserve the summaries' share, so vLLM counts both."""
    if memory.RESERVE.done:
        return
    report_layers(vllm_config)
    impls = [(n, l.impl) for n, l in model_attention_layers(vllm_config).items()
             if isinstance(l.impl, LocksFlashAttentionImpl) and l.impl.locks is not None]
    rows, _ = cuda_compat.engine_limits(vllm_config)
    width = cuda_compat.block_table_width(vllm_config, KERNEL_PAGE_SIZE)
    shapes = {impl._make_decoder(n).shape(width, query.dtype, query.device) for n, impl in impls}
    plan_bytes = sum(_POOL.reserve(shape, rows) for shape in shapes)
    esize = query.element_size()
    kv_layers = [(getattr(getattr(l.impl, "kvlocks_decision", None), "outcome", None) == layer_table.LOCKS,
                  int(getattr(l.impl, "num_kv_heads", 0) or 0), int(getattr(l.impl, "head_size", 0) or 0), esize)
                 for l in model_attention_layers(vllm_config).values()
                 if not getattr(l.impl, "kv_sharing_target_layer_name", None)]
    kv_layers = [x for x in kv_layers if x[1] and x[2]]
    hybrid = any(getattr(l.impl, "sliding_window", None) not in (None, -1, 0, (-1, -1))
                 for l in model_attention_layers(vllm_config).values())  # FlashAttention: (W - 1, 0)
    config = impls[0][1].locks if impls else current_config()
    memory.RESERVE.model = memory.model_bytes(config, kv_layers, hybrid=hybrid)
    memory.RESERVE.plan_bytes = plan_bytes
    cc = vllm_config.cache_config
    if getattr(cc, "kv_cache_memory_bytes", None):
        memory.RESERVE.fixed_pool = True
        memory.RESERVE.take(0, query.device)
    else:
        free = memory.free_in_share(query.device, float(cc.gpu_memory_utilization))
        memory.RESERVE.take(memory.reserve_bytes(memory.RESERVE.model.rho, free), query.device)
    startup_log.info("kvlocks: reserved during vLLM's profiling run: LOCKS plans %.1f MiB, summaries %.1f MiB "
                     "(summaries / K/V = %.3f)", plan_bytes / 2**20, memory.RESERVE.bytes / 2**20,
                     memory.RESERVE.model.rho)


def _log_pool(impls: list) -> None:
    """After a group's stores are (re)bound: release the reserve and log the pool in tokens."""
    memory.RESERVE.release()
    stores = [ref().store for ref in _DECODERS if ref() is not None and ref().store is not None]
    summaries = sum(st.nbytes() for st in stores)
    blocks = impls[0].decoder.store.num_blocks
    model, r = memory.RESERVE.model, memory.RESERVE
    if model is None:
        startup_log.info("kvlocks: KV pool of %d blocks; LOCKS summaries %.1f MiB", blocks, summaries / 2**20)
        return
    have, without = memory.pool_tokens(blocks, KERNEL_PAGE_SIZE, model, summaries + r.plan_bytes)
    where = "on top of kv_cache_memory_bytes" if r.fixed_pool else "inside gpu_memory_utilization"
    startup_log.info("kvlocks: the KV pool holds %d tokens per layer with LOCKS (summaries %.1f MiB, plans %.1f MiB, "
                     "%s); without LOCKS it would hold about %d", have, summaries / 2**20, r.plan_bytes / 2**20, where,
                     have if r.fixed_pool else without)
    if not r.fixed_pool and summaries > r.bytes:
        startup_log.warning("kvlocks: LOCKS summaries (%.1f MiB) exceed the share reserved during profiling "
                            "(%.1f MiB) by %.1f MiB", summaries / 2**20, r.bytes / 2**20, (summaries - r.bytes) / 2**20)


class LocksFlashAttentionImpl(_StockImpl):
    """vLLM's FlashAttention implementation with LOCKS single-token decode."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.locks = current_config()
        self.decoder: LocksDecoder | None = None
        self.kvlocks_decision = None  # read by the layer table (layers.py)
        self._vllm_config = current_vllm_config()
        if self.locks is not None:
            startup.check(self.locks, platform="cuda", kv_cache_dtype=self.kv_cache_dtype)
            self.kvlocks_decision = layer_table.decide(self._facts(), head_dims=KERNEL_HEAD_DIMS, sinks_supported=True,
                                                       dense="FlashAttention")
            if self.kvlocks_decision.outcome != layer_table.LOCKS:
                self.locks = None

    def _facts(self) -> layer_table.LayerFacts:
        window = tuple(self.sliding_window or (-1, -1))  # FlashAttention's (left, right): (W - 1, 0)
        return layer_table.LayerFacts(
            attn_type=self.attn_type, sliding_window=None if window == (-1, -1) else window[0] + 1,
            alibi=self.alibi_slopes is not None, soft_cap=self.logits_soft_cap or None,
            sinks=getattr(self, "sinks", None) is not None, head_size=self.head_size,
            kv_shared_with=getattr(self, "kv_sharing_target_layer_name", None))

    def _make_decoder(self, layer_name: str) -> LocksDecoder:
        if self.decoder is None:
            self.decoder = LocksDecoder(self.locks, num_kv_heads=self.num_kv_heads, group=self.num_queries_per_kv,
                                        head_dim=self.head_size, scale=self.scale, pool=_POOL,
                                        layer=layer_number(layer_name), sinks=getattr(self, "sinks", None),
                                        dense_below=dense_below_for(self.num_kv_heads, self.head_size))
            _DECODERS.append(weakref.ref(self.decoder))
        return self.decoder

    def attach(self, layer_name: str, kv_cache: torch.Tensor) -> None:
        """Called by the builder outside any capture: make the decoder and bind its store."""
        keys = cuda_compat.split_flash_kv_cache(kv_cache, self.num_kv_heads, self.head_size)[0]
        self._make_decoder(layer_name).bind(keys)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self.decoder is not None and self.decoder.store is not None:
            self.decoder.store.note_writes(slot_mapping)

    def kvlocks_external_write(self, layer, slot_mapping: torch.Tensor) -> None:
        """After a KV connector wrote these slots (eager, before the forward): build whole pages."""
        kv = cuda_compat.layer_kv_cache(layer)
        if self.decoder is None or self.decoder.store is None or kv is None:
            return
        keys = cuda_compat.split_flash_kv_cache(kv, self.num_kv_heads, self.head_size)[0]
        self.decoder.store.external_write(keys, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None and self.kvlocks_decision is not None and self._vllm_config is not None:
            _at_profiling(self._vllm_config, query)  # vLLM's profiling run: every layer exists now
        step = getattr(attn_metadata, STEP_ATTR, None) if attn_metadata is not None else None
        if step is None or self.decoder is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise cuda_compat.VllmCompatError("kvlocks: quantized attention outputs (output_scale) are not supported "
                                              "by the LOCKS backend")
        if not step.uniform_decode:  # prefill or a mixed batch: FlashAttention for every row first
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        keys, values = cuda_compat.split_flash_kv_cache(kv_cache, self.num_kv_heads, self.head_size)
        captured = cuda_compat.is_capturing()
        if not captured:
            self.decoder.bind(keys)  # a no-op unless vLLM re-allocated its cache
        self.decoder.run(step, query, keys, values, output, captured=captured)
        return output


class LocksFlashAttentionMetadataBuilder(_StockBuilder):
    """FlashAttention's builder, plus the LOCKS rows of each step and full graphs for decode only."""

    _cudagraph_support = cuda_compat.cg_support("UNIFORM_SINGLE_TOKEN_DECODE")

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.locks = current_config()
        cuda_compat.check_engine(vllm_config)
        if self.locks is not None:
            self._check_group(vllm_config, layer_names)
        rows, _ = cuda_compat.engine_limits(vllm_config)
        self._sparse = torch.zeros(rows + 1, dtype=torch.bool, device=device)
        self._flash_lens = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._locks_lens = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self._layers = None
        self._bound: dict = {}  # layer name -> data_ptr of the KV cache its store was bound to

    def _check_group(self, vllm_config, layer_names) -> None:
        """The layer table (if the profiling run did not log it) and this KV cache group: LOCKS
        layers sharing a group with a layer that cannot run LOCKS run FlashAttention (one metadata
        per group), said in a warning; an error in strict mode."""
        decisions = report_layers(vllm_config)
        group = [n for n in layer_names if n in decisions]
        demoted = layer_table.demote(decisions, group, "FlashAttention")
        if demoted:
            startup_log.warning("kvlocks: %s", layer_table.table({n: decisions[n] for n in demoted}))
            err = layer_table.strict_error({n: decisions[n] for n in demoted}) if current_settings().strict else None
            if err:
                raise ValueError(err)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False  # cascade attention would read the cut key lengths as the real ones

    def _attach(self) -> list | None:
        """The LOCKS impls of this builder's layers with their stores bound; None if any layer
        of the group cannot run LOCKS (the group then runs FlashAttention unchanged)."""
        if self._layers is None:
            self._layers = cuda_compat.attention_layers(self.vllm_config, self.layer_names)
        impls, rebound = [], False
        for name, layer in self._layers.items():
            impl, kv = layer.impl, cuda_compat.layer_kv_cache(layer)
            if self.locks is None or not isinstance(impl, LocksFlashAttentionImpl) or impl.locks is None or kv is None:
                return None
            if self._bound.get(name) != kv.data_ptr():  # first step, or vLLM re-allocated its cache
                memory.RESERVE.release()  # the room held for the summaries since profiling: theirs now
                impl.attach(name, kv)
                self._bound[name] = kv.data_ptr()
                rebound = True
            impls.append(impl)
        if rebound and impls:
            _log_pool(impls)
        return impls or None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        _maybe_write_counters()
        impls = self._attach()
        view = cuda_compat.batch_view(common_attn_metadata)
        if impls is None or not view.causal:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        b = view.num_reqs
        sparse, flash_lens, locks_lens = step_lens(view.query_start_loc, view.seq_lens, self.locks.page_size,
                                                   self.locks.pages_per_step, impls[0].decoder.dense_below)
        self._sparse[:b].copy_(sparse)  # persistent buffers: what a captured graph reads at replay
        self._flash_lens[:b].copy_(flash_lens)
        self._locks_lens[:b].copy_(locks_lens)
        common = cuda_compat.replace_common(common_attn_metadata, seq_lens=self._flash_lens[:b])
        metadata = super().build(common_prefix_len, common, fast_build)
        step = LocksStep(num_reqs=b, uniform_decode=view.max_query_len == 1 and view.num_tokens == b,
                         query_start_loc=view.query_start_loc, seq_lens=view.seq_lens, block_table=view.block_table,
                         sparse=self._sparse[:b], locks_lens=self._locks_lens[:b], max_seq_len=view.max_seq_len,
                         decode_rows=view.decode_rows)
        width, dtype = view.block_table.shape[1], self.vllm_config.model_config.dtype
        for shape in {impl.decoder.shape(width, dtype, self.device) for impl in impls}:
            _POOL.prepare(shape, b)
        setattr(metadata, STEP_ATTR, step)
        return metadata

    def update_block_table(self, metadata, blk_table, slot_mapping):
        new = super().update_block_table(metadata, blk_table, slot_mapping)
        step = getattr(metadata, STEP_ATTR, None)
        if step is not None and self._attach() is not None:
            setattr(new, STEP_ATTR, step.with_block_table(blk_table))
        elif step is not None:  # a stock group cannot reuse metadata whose key lengths were cut
            raise cuda_compat.VllmCompatError("kvlocks: KV cache groups mix LOCKS and non-LOCKS layers")
        return new


class LocksFlashAttentionBackend(_StockBackend):
    """vLLM's ``FLASH_ATTN`` backend (same name and cache layout) with the LOCKS impl and builder."""

    @staticmethod
    def get_impl_cls():
        return LocksFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return LocksFlashAttentionMetadataBuilder

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's check of this backend for a layer: engine-wide settings LOCKS cannot run (dtype,
        kv_cache_dtype, block_size) are refused here, naming the setting, instead of vLLM quietly
        choosing another backend without LOCKS (startup.py)."""
        config = current_config()
        if config is not None:
            startup.check(config, platform="cuda", dtype=kwargs.get("dtype"),
                          kv_cache_dtype=kwargs.get("kv_cache_dtype"), block_size=kwargs.get("block_size"))
        return super().validate_configuration(*args, **kwargs)

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None):  # 0.26 calls it bare, 0.32 with a spec
        config = current_config()
        return [config.page_size if config is not None else KERNEL_PAGE_SIZE]
