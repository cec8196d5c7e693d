"""One step of the LOCKS CUDA backend, apart from vLLM's classes: which rows decode sparsely, the
plans, and the eager / captured decode paths (see :mod:`kvlocks.integrations.vllm.cuda.backend`).

Rows. A row is a *LOCKS row* when its query is one token (a decode step), its pages do not all
fit the budget (``ceil(seq_len / S) > k``) and the step's rows hold more tokens together than the
crossover with dense attention (``"dense_below"``,
:func:`kvlocks.integrations.vllm.settings.resolve_dense_below`; :func:`kvlocks.plan.sparse_rows`).
In a batch of single-token decodes only (the batches vLLM runs in its full CUDA graphs)
FlashAttention does not run: kvlocks' plans attend every row, the LOCKS rows over their selected pages and the others over
all their pages (``sparse_lens`` 0: neither scored nor selected; exact attention, kvlocks' split-KV
kernel, with as many programs as a dense launch of the crossover's length). In any other
batch (prefill, chunked prefill, mixed) vLLM's FlashAttention runs for every row, with the LOCKS
rows' key length cut to one token (:func:`step_lens`: that output is discarded), and kvlocks'
kernels then attend the LOCKS rows and overwrite them.

(H200, Llama-3.1-8B shape, 130K x 1: FlashAttention over the LOCKS rows' one key and the merge of
the two outputs took 413 us of a 7.50 ms step; docs/results/2026-12-04-h200-vllm-tpot.)

Plans. :class:`~kvlocks.plan.DecodePlan` buffers depend on the batch size; :class:`PlanPool` keeps
one plan per power-of-two batch up to a cap set by a memory budget (``KVLOCKS_VLLM_PLAN_GIB``,
default 2), and a batch of B rows runs as chunks of those sizes (B's binary digits), so a CUDA
graph of any batch size reads plans allocated before capture, and their total memory is bounded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import torch

from kvlocks import env
from kvlocks.config import KernelOptions, LocksConfig, default_kernel_options
from kvlocks.integrations.vllm.compat import VllmCompatError
from kvlocks.integrations.vllm.cuda.store import CudaSummaryStore
from kvlocks.integrations.vllm.sinks import apply_sinks
from kvlocks.pages import num_pages
from kvlocks.plan import DecodePlan, paged_score, sparse_lens, sparse_rows

log = logging.getLogger(__name__)

PLAN_BUDGET_ENV = "KVLOCKS_VLLM_PLAN_GIB"
# Eager steps whose rows hold at most this many (page, KV head) items build without a host sync, one
# program per item and most of them skipping (128K tokens x 8 KV heads x 1 row); a larger step (many
# long rows in a mixed batch) gathers its stale pages on the host first and launches only those.
ASYNC_BUILD_ITEMS = 1 << 16


def step_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, page_size: int, k: int, dense_below: int = 0):
    """``(sparse bool [B], flash_lens int32 [B], locks_lens int32 [B])`` for one batch.

    ``query_start_loc`` int32 ``[B + 1]``, ``seq_lens`` int32 ``[B]``; ``dense_below``: a step whose
    rows hold at most this many tokens together attends densely (:func:`kvlocks.plan.sparse_rows`).
    LOCKS rows get ``flash_lens = 1`` and ``locks_lens = seq_len``; the others ``flash_lens = seq_len``, ``locks_lens = 0``.
    """
    sparse = sparse_rows(query_start_loc[1:] - query_start_loc[:-1], seq_lens, page_size=page_size, k=k,
                         dense_below=dense_below)  # [B]
    return sparse, torch.where(sparse, torch.ones_like(seq_lens), seq_lens), sparse_lens(sparse, seq_lens)


@dataclass
class LocksStep:
    """What every layer's forward reads about this step (device tensors live in persistent buffers)."""

    num_reqs: int
    uniform_decode: bool  # every row one query token, token r = row r (the CUDA-graph case)
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B], real lengths
    block_table: torch.Tensor  # int32 [B, W]
    sparse: torch.Tensor  # bool [B]
    locks_lens: torch.Tensor  # int32 [B]: seq_len on LOCKS rows, 0 elsewhere
    max_seq_len: int | None = None  # host: at least the longest row (None: read seq_lens back)
    decode_rows: int | None = None  # host: rows of one query token, the only ones LOCKS may take (None: unknown)

    def with_block_table(self, block_table: torch.Tensor) -> "LocksStep":
        return dataclasses.replace(self, block_table=block_table[: self.num_reqs])


def binary_chunks(n: int, cap: int) -> list[tuple[int, int]]:
    """``(start, size)`` chunks covering ``n`` rows: sizes are ``cap`` (a power of two) while they fit,
    then the binary digits of the rest, largest first."""
    out, start = [], 0
    while n - start >= cap:
        out.append((start, cap))
        start += cap
    size = cap
    while start < n:
        size //= 2
        if n - start >= size:
            out.append((start, size))
            start += size
    return out


def _tensor_bytes(obj, seen=None) -> int:
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.numel())
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


class PlanPool:
    """DecodePlans by (shape, batch size), batch sizes powers of two up to a memory-bound cap."""

    def __init__(self, budget_bytes: int | None = None, max_rows: int = 1 << 16,
                 options: KernelOptions | None = None) -> None:
        gib = env.number(PLAN_BUDGET_ENV)
        self.budget = int(gib * 2**30) if budget_bytes is None else int(budget_bytes)
        self._options = options  # None: the plugin's "kernels" setting, read at the first plan
        self.max_rows = max_rows
        self.plans: dict = {}
        self.caps: dict = {}

    def cap(self, shape: tuple) -> int:
        """Largest chunk (a power of two) whose plans, all sizes up to it, fit the budget."""
        if shape not in self.caps:
            first = self.plans.setdefault((shape, 1), self._make(shape, 1))
            per_row = _tensor_bytes(first)
            c = 1
            while c * 2 <= self.max_rows and (4 * c - 1) * per_row <= self.budget:
                c *= 2
            self.caps[shape] = c
            log.info("kvlocks: LOCKS plans %s: %.1f MiB per batch row, chunks of up to %d rows", shape[:4],
                     per_row / 2**20, c)
        return self.caps[shape]

    def chunks(self, shape: tuple, n: int) -> list[tuple[int, int]]:
        return binary_chunks(n, self.cap(shape))

    def prepare(self, shape: tuple, n: int) -> None:
        """Make the plans a batch of ``n`` rows needs (call outside CUDA-graph capture)."""
        for _, size in self.chunks(shape, n):
            self.get(shape, size)

    def reserve(self, shape: tuple, rows: int) -> int:
        """Make every plan a batch of up to ``rows`` rows can use (during vLLM's profiling run, so
        that vLLM counts them as non-KV memory); returns the bytes of this shape's plans."""
        size, top = 1, min(self.cap(shape), max(rows, 1))
        while size <= top:
            self.get(shape, size)
            size *= 2
        return sum(_tensor_bytes(p) for (sh, _), p in self.plans.items() if sh == shape)

    def get(self, shape: tuple, size: int, *, create: bool = True) -> DecodePlan:
        key = (shape, size)
        if key not in self.plans:
            if not create:
                raise VllmCompatError(f"kvlocks: no LOCKS plan for {size} rows {shape[:4]} was prepared before "
                                      "CUDA-graph capture (the metadata builder prepares them)")
            self.plans[key] = self._make(shape, size)
        return self.plans[key]

    @property
    def options(self) -> KernelOptions | None:
        """The plans' KernelOptions: the constructor's, else ``$KVLOCKS_VLLM_CONFIG``'s ``"kernels"``;
        ``batch_invariant`` on under vLLM's batch-invariant mode."""
        if self._options is None:
            from kvlocks.integrations.vllm.cuda import compat as cuda_compat
            from kvlocks.integrations.vllm.plugin import current_settings

            options = current_settings().kernels or default_kernel_options()
            if cuda_compat.batch_invariant() and not options.batch_invariant:
                options = options.replace(batch_invariant=True)
            self._options = options
        return self._options

    def _make(self, shape: tuple, size: int) -> DecodePlan:
        hkv, g, d, width, scale, dtype, device, config, backend, dense_below = shape
        return DecodePlan(batch=size, num_kv_heads=hkv, group=g, head_dim=d, max_pages=width, config=config,
                          dtype=dtype, device=device, scale=scale, backend=backend, options=self.options,
                          dense_tokens=min(width * config.page_size, dense_below))


class LocksDecoder:
    """The LOCKS part of one attention layer's forward (a FlashAttention impl owns one).

    Parameters
    ----------
    config : LocksConfig
    num_kv_heads, group, head_dim, scale : this layer's Hkv (local), G, D and softmax scale
    pool : the process's PlanPool
    layer : decoder layer number (traces)
    backend : kernels' backend (None: Triton on CUDA)
    sinks : learned sink logits ``[Hq]`` of this layer, or None (:mod:`kvlocks.integrations.vllm.sinks`)
    dense_below : steps of at most this many tokens attend densely (the builder's rule; sizes the plans)
    """

    def __init__(self, config: LocksConfig, *, num_kv_heads: int, group: int, head_dim: int, scale: float,
                 pool: PlanPool, layer: int | None = None, backend: str | None = None,
                 sinks: torch.Tensor | None = None, dense_below: int = 0) -> None:
        self.config, self.hkv, self.g, self.d, self.scale = config, num_kv_heads, group, head_dim, scale
        self.dense_below = dense_below
        self.pool, self.layer, self.backend, self.sinks = pool, layer, backend, sinks
        self.store: CudaSummaryStore | None = None
        self._store_key = None
        self.trace_path = env.get("KVLOCKS_VLLM_TRACE")
        self.verify = env.flag("KVLOCKS_VLLM_VERIFY")
        self.check = self.verify or env.flag("KVLOCKS_VLLM_CHECK")
        self.ignore_tags = env.flag("KVLOCKS_VLLM_IGNORE_TAGS")
        self._warned_trace = False
        self.eager_steps = 0  # eager forwards that attended LOCKS rows (outside CUDA graphs; host count)

    def shape(self, width: int, dtype, device) -> tuple:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        be = self.backend or ("triton" if device.type == "cuda" else "torch")
        return (self.hkv, self.g, self.d, width, self.scale, dtype, device, self.config, be, self.dense_below)

    def bind(self, k_cache: torch.Tensor) -> CudaSummaryStore:
        """The store for this cache (``k_cache [NB, S, Hkv, D]``); a new cache gets a new store."""
        key = (k_cache.data_ptr(), tuple(k_cache.shape))
        if key != self._store_key:
            nb, bs = k_cache.shape[:2]
            self.store = CudaSummaryStore(self.config, nb, bs, self.hkv, self.d, k_cache.device, backend=self.backend,
                                          verify=self.verify, ignore_tags=self.ignore_tags)
            self._store_key = key
            log.info("kvlocks: LOCKS summaries for %d blocks: %.1f MiB (layer %s)", nb, self.store.nbytes() / 2**20,
                     self.layer)
        return self.store

    def run(self, step: LocksStep, query, k_cache, v_cache, output, *, captured: bool) -> None:
        """Uniform single-token decode (``step.uniform_decode``, the CUDA-graph case): every row is
        attended here and written into ``output [T, Hq, D]`` (FlashAttention did not run): LOCKS rows
        over their selected pages, the others over all their pages (they fit the budget, so the
        selection keeps every page: exact attention). Otherwise (mixed batches, eager only)
        FlashAttention wrote every row and the LOCKS rows are overwritten."""
        if captured:
            if not step.uniform_decode:
                raise VllmCompatError("kvlocks: a CUDA graph was captured for a batch that is not uniform "
                                      "single-token decode; the LOCKS backend declares UNIFORM_SINGLE_TOKEN_DECODE "
                                      "support")
            if self.trace_path and not self._warned_trace:
                log.warning("kvlocks: KVLOCKS_VLLM_TRACE records eager steps only; CUDA-graph steps are not traced "
                            "(run with enforce_eager=True to trace every step)")
                self._warned_trace = True
            self._decode(step, query, k_cache, v_cache, output, check=self.check, create=False)
        elif step.uniform_decode:
            self._eager_decode(step, query, k_cache, v_cache, output)
        else:
            self._eager_mixed(step, query, k_cache, v_cache, output)

    def _decode(self, step, query, k_cache, v_cache, output, *, check: bool, create: bool, trace=None) -> None:
        """Every row of a uniform decode batch (token r = row r) through the plans, into ``output``.
        Fixed grids, no host sync, no allocation when the plans exist (``create=False``: the
        captured path). The page each row's new token filled is built first. ``trace``:
        ``(lens_host, built)`` of an eager step, to record the LOCKS rows' pages."""
        store, b = self.store, step.num_reqs
        store.build_new(k_cache, step.block_table, step.seq_lens)
        if check:
            store.check_tags(step.block_table, step.locks_lens)
            store.verify_used(k_cache, step.block_table, step.locks_lens)
        shape = self.shape(step.block_table.shape[1], query.dtype, query.device)
        for start, size in self.pool.chunks(shape, b):
            sl = slice(start, start + size)
            plan = self.pool.get(shape, size, create=create)
            _, lse = plan.run(query[sl], k_cache, v_cache, store.summaries, step.block_table[sl], step.seq_lens[sl],
                              out=output[sl], sparse_lens=step.locks_lens[sl])
            if self.sinks is not None:
                apply_sinks(output[sl], lse, self.sinks)
            if trace is not None:
                self._trace_rows(step, query, k_cache, v_cache, sl, plan.pages, *trace)

    def _validate(self, step, k_cache):
        """Outside a graph: build every full page whose summary is missing or stale and run the
        debug checks. No host sync where the step carries its longest row (``max_seq_len``), its
        rows' pages are at most ``ASYNC_BUILD_ITEMS`` (page, head) items and no trace is kept
        (:meth:`CudaSummaryStore.ensure_async`: one launch over them all, the valid ones skipped);
        else the stale pages are gathered on the host first
        (:meth:`~kvlocks.integrations.vllm.store.TaggedSummaryStore.ensure`). Returns
        ``(lens_host, built)`` for a trace, else None."""
        store, b = self.store, step.num_reqs
        lens_host, longest = None, step.max_seq_len
        if self.trace_path or longest is None:
            lens_host = step.seq_lens.cpu()
            longest = int(lens_host.max()) if b else 0
        trace, items = None, b * min(num_pages(longest, self.config.page_size), step.block_table.shape[1]) * self.hkv
        if self.trace_path:
            trace = (lens_host, store.ensure(k_cache, step.block_table, step.seq_lens, longest))
        elif items > ASYNC_BUILD_ITEMS:
            store.ensure(k_cache, step.block_table, step.seq_lens, longest)
        else:
            store.ensure_async(k_cache, step.block_table, step.seq_lens, longest)
        if self.check:
            store.check_tags(step.block_table, step.locks_lens)
            store.verify_used(k_cache, step.block_table, step.locks_lens,
                              width=max(1, longest // self.config.page_size))
        return trace

    def _eager_decode(self, step, query, k_cache, v_cache, output) -> None:
        """A uniform decode step outside a graph: make every full page valid, then the captured
        path's launches (which also compiles them before vLLM captures this batch size)."""
        trace = self._validate(step, k_cache)
        self.eager_steps += 1
        self._decode(step, query, k_cache, v_cache, output, check=False, create=True, trace=trace)

    def _eager_mixed(self, step, query, k_cache, v_cache, output) -> None:
        """A mixed batch (FlashAttention ran for every row): make every full page valid, then
        attend the LOCKS rows and overwrite their outputs. A step without single-token rows (a
        prefill) has no LOCKS row: nothing is read back beyond what :meth:`_validate` reads."""
        store = self.store
        trace = self._validate(step, k_cache)
        if step.decode_rows == 0:
            return
        rows = step.sparse.cpu().nonzero().flatten()
        if not rows.numel():
            return
        self.eager_steps += 1
        dev_rows = rows.to(query.device)
        tok = step.query_start_loc[dev_rows].long()  # [R] the decode token of each LOCKS row
        q, bt, lens = query[tok], step.block_table[dev_rows], step.seq_lens[dev_rows]
        shape = self.shape(bt.shape[1], query.dtype, query.device)
        for start, size in self.pool.chunks(shape, rows.numel()):
            sl = slice(start, start + size)
            plan = self.pool.get(shape, size)
            out, lse = plan.run(q[sl], k_cache, v_cache, store.summaries, bt[sl], lens[sl])
            if self.sinks is not None:
                out = apply_sinks(out, lse, self.sinks)
            output[tok[sl]] = out
            if self.trace_path:
                ref_pages, ranking = self._reference(q[sl], k_cache, v_cache, bt[sl], lens[sl])
                self._trace(rows[sl], *trace, bt[sl, 0], plan.pages, ref_pages, ranking)

    def _trace_rows(self, step, query, k_cache, v_cache, sl, pages, lens_host, built) -> None:
        """Trace the LOCKS rows of chunk ``sl`` of a uniform decode step (row r = token r)."""
        sparse = step.sparse[sl].cpu()
        if not bool(sparse.any()):
            return
        local = sparse.nonzero().flatten()
        dev = local.to(query.device)
        q, bt, lens = query[sl][dev], step.block_table[sl][dev], step.seq_lens[sl][dev]
        ref_pages, ranking = self._reference(q, k_cache, v_cache, bt, lens)
        self._trace(local + sl.start, lens_host, built, bt[:, 0], pages[dev], ref_pages, ranking)

    def _reference(self, q, k_cache, v_cache, block_table, lens):
        """The plan's torch backend (the references, every mode of the config) on the same query,
        cache and summaries: its pages and the Eq. 4 ranking (what the kernels' pages are checked
        against in traces)."""
        c, summaries = self.config, self.store.summaries
        plan = DecodePlan(batch=q.shape[0], num_kv_heads=self.hkv, group=self.g, head_dim=self.d,
                          max_pages=block_table.shape[1], config=c, dtype=q.dtype, device=q.device, scale=self.scale,
                          backend="torch")
        plan.run(q, k_cache, v_cache, summaries, block_table, lens)
        _, _, ranking = paged_score(q, summaries, block_table, lens, scale=self.scale, combine=c.combine,
                                    backend="torch")
        return plan.pages, ranking

    def _trace(self, rows, lens_host, built, block0, pages, ref_pages, ranking) -> None:
        pages, block0, ref_pages, ranking = pages.cpu(), block0.cpu(), ref_pages.cpu(), ranking.cpu()
        s = self.config.page_size
        with open(self.trace_path, "a") as f:
            for i, r in enumerate(rows.tolist()):
                n = int(lens_host[r])
                rec = {"pid": os.getpid(), "layer": self.layer, "seq_len": n, "block0": int(block0[i]),
                       "pages": pages[i].tolist(), "built": int(built[r]), "ref_pages": ref_pages[i].tolist(),
                       "ranking": [[round(x, 5) for x in h] for h in ranking[i, :, : n // s].tolist()]}
                f.write(json.dumps(rec) + "\n")
