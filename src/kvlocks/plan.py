"""The paged decode path: one function per step over a page-table layout, and the plan/run object.

Layout (``docs/paged-layout.md``): K/V in a paged cache ``[num_pages, S, Hkv, D]``, each sequence's pages
in a block table ``[B, max_pages]``, summaries in a :class:`~kvlocks.summary.store.SummaryStore`
per physical page. (The per-sequence reference functions with the same steps are
:func:`kvlocks.score_pages` and :func:`kvlocks.select_pages`.)

Every function takes ``backend="torch" | "cpu" | "triton" | None`` (:data:`PLAN_BACKENDS`); None
picks Triton for CUDA tensors and the torch backend otherwise. The torch backend gathers each
sequence's pages into the reference layout and calls the reference functions (the spec), one
sequence at a time: it is for checking, not for speed. The ``cpu`` backend runs the same steps
for the whole batch in a few large operations (:mod:`kvlocks.scoring.cpu`,
:mod:`kvlocks.selection.cpu`, :mod:`kvlocks.attention.cpu`); it reads the host freely and
allocates, so it is for CPU tensors. ``options``: :class:`~kvlocks.config.KernelOptions` for the
Triton kernels (None: the defaults). What the Triton backend supports:
:func:`kvlocks.kernels_support.kernel_support`.

Which rows of a batch decode sparsely (:func:`sparse_rows`) is decided here, once, for every path.
"""

from __future__ import annotations

import math

import torch

from kvlocks._checks import check_out
from kvlocks.attention.reference import sparse_decode as ref_sparse_decode
from kvlocks.cache.layout import paged_to_token_major
from kvlocks.config import KernelOptions, LocksConfig, default_kernel_options
from kvlocks.kernels_support import check_config
from kvlocks.pages import full_pages, num_pages
from kvlocks.scoring.reference import combine_group, score_pages_from_centroids, score_pages_from_summaries
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary.store import SummaryStore
from kvlocks.summary.build import build_summaries


PLAN_BACKENDS = ("torch", "cpu", "triton")


def resolve_backend(backend: str | None, device) -> str:
    """``"triton"`` for CUDA tensors, ``"torch"`` otherwise, unless given explicitly."""
    if backend is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if backend not in PLAN_BACKENDS:
        raise ValueError(f"backend={backend!r}: allowed {PLAN_BACKENDS} or None")
    return backend


def sparse_rows(query_lens: torch.Tensor, seq_lens: torch.Tensor, *, page_size: int, k: int,
                dense_below: int = 0) -> torch.Tensor:
    """bool ``[B]``: the rows that decode sparsely, a single query token (a decode step) over more
    pages than a step attends (``ceil(seq_lens / S) > k``, ``k = LocksConfig.pages_per_step``), in a
    step whose rows hold more than ``dense_below`` tokens together (a serving path's crossover with
    dense attention, e.g. the vLLM plugin's ``"dense_below"``); the others read every page: exact
    attention. The crossover is per step, not per row: the dense rows' K/V reads add up over the
    step (in vLLM at 8K tokens a row, one row is faster dense and four rows faster selecting,
    docs/vllm.md).

    query_lens, seq_lens : int ``[B]`` (tokens queried at this step; tokens in the sequence)
    """
    over = (query_lens == 1) & (num_pages(seq_lens, page_size) > k)
    return over & (seq_lens.sum() > dense_below) if dense_below > 0 else over


def sparse_lens(sparse: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 ``[B]``: ``seq_lens`` on the rows that decode sparsely (``sparse``, :func:`sparse_rows`),
    0 on the others: what :meth:`DecodePlan.run` scores and selects."""
    return torch.where(sparse, seq_lens, torch.zeros_like(seq_lens)).to(torch.int32)


def dense_page_lists(pages: torch.Tensor, seq_lens: torch.Tensor, sparse_lens: torch.Tensor, width: int,
                     page_size: int) -> torch.Tensor:
    """int32 ``[B, Hkv, max(k, width)]``: the selected ``pages [B, Hkv, k]`` on rows whose
    ``sparse_lens`` is nonzero, every page ``0 .. ceil(seq_len / S) - 1`` on the others; -1 padded."""
    bsz, hkv, k = pages.shape
    w = max(k, width)
    ids = torch.arange(w, dtype=torch.int32, device=pages.device)
    every = torch.where(ids < num_pages(seq_lens, page_size)[:, None], ids, -1)  # [B, w]
    listed = torch.full((bsz, hkv, w), -1, dtype=torch.int32, device=pages.device)
    listed[..., :k] = pages
    return torch.where((sparse_lens == 0)[:, None, None], every[:, None, :].expand(bsz, hkv, w), listed)


def paged_score(queries, summaries: SummaryStore, block_table, seq_lens, *, scale=None, combine="mean_share",
                backend=None, workspace=None, options: KernelOptions | None = None, centroid: bool = False):
    """Eq. 4 scores ``[B, Hkv, G, max_pages]``, per-head LSE ``[B, Hkv, G]`` and the combined
    ranking ``[B, Hkv, max_pages]`` (float32; entries past each sequence's full pages undefined);
    from the centroids alone with ``centroid`` (Eq. 4 at rank 0). ``workspace``: a
    :class:`~kvlocks.scoring.triton_combine.ScoreWorkspace` (Triton; for ``centroid`` one sized by
    :func:`kvlocks.scoring.triton_centroid.centroid_workspace`). ``summaries``: a
    :class:`~kvlocks.summary.store.SummaryStore` read through ``block_table``; for the ``cpu``
    backend also a :class:`~kvlocks.scoring.cpu.ScoringBuffers` (row ``b * Hkv + h`` holds the pages
    of sequence b, head h in logical order; ``block_table`` is not read for it)."""
    backend = resolve_backend(backend, queries.device)
    if backend == "triton":
        if centroid:
            from kvlocks.scoring.triton_centroid import score_pages_centroid

            return score_pages_centroid(queries, summaries, block_table, seq_lens, scale=scale, combine=combine,
                                        workspace=workspace)
        from kvlocks.scoring.triton import score_pages_paged

        return score_pages_paged(queries, summaries, block_table, seq_lens, scale=scale, combine=combine,
                                 workspace=workspace, options=options)
    if backend == "cpu":
        return _cpu_score(queries, summaries, block_table, seq_lens, scale=scale, combine=combine, centroid=centroid)
    bsz, hq, d = queries.shape
    hkv = summaries.num_kv_heads
    g, max_pages, s = hq // hkv, block_table.shape[1], summaries.page_size
    scores = torch.full((bsz, hkv, g, max_pages), float("-inf"), device=queries.device)
    lse = torch.full((bsz, hkv, g), float("-inf"), device=queries.device)
    ranking = torch.full((bsz, hkv, max_pages), float("-inf"), device=queries.device)
    for b in range(bsz):
        pc = full_pages(int(seq_lens[b]), s)
        if pc == 0:
            continue
        ps = summaries.gather(block_table[b, :pc])  # leading dims [Hkv]
        score = score_pages_from_centroids if centroid else score_pages_from_summaries
        sc = score(queries[b].view(hkv, g, d), ps, scale=scale)  # [Hkv, G, Pc]
        scores[b, :, :, :pc] = sc
        lse[b] = torch.logsumexp(sc, dim=-1)
        ranking[b, :, :pc] = combine_group(sc, combine)
    return scores, lse, ranking


def _cpu_score(queries, summaries, block_table, seq_lens, *, scale, combine, centroid):
    """The ``cpu`` backend of :func:`paged_score` (same outputs; one batched product for the batch)."""
    from kvlocks.scoring.cpu import ScoringBuffers, gather_buffers, layout_scores

    bsz, hq, d = queries.shape
    s, width = (summaries.c.shape[3] if isinstance(summaries, ScoringBuffers) else summaries.page_size), \
        block_table.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    full = full_pages(seq_lens.long(), s)  # [B]
    pmax = int(full.max()) if bsz else 0
    if isinstance(summaries, ScoringBuffers):
        if pmax > summaries.pages:
            raise ValueError(f"ScoringBuffers hold {summaries.pages} pages, the longest row has {pmax} full pages: "
                             "sync them with the summaries first")
        w, c = summaries.w[:, :pmax], summaries.c[:, :pmax]
    else:
        w, c = gather_buffers(summaries, block_table, pmax)
    hkv = w.shape[0] // bsz
    g = hq // hkv
    sc = layout_scores(queries.reshape(bsz * hkv, g, d), w, c, scale, centroid=centroid).view(bsz, hkv, g, pmax)
    scores = torch.full((bsz, hkv, g, width), float("-inf"), device=queries.device)
    scores[..., :pmax] = sc.masked_fill(torch.arange(pmax, device=queries.device) >= full.view(bsz, 1, 1, 1),
                                        float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
    return scores, lse, combine_group(scores, combine)


def paged_select(ranking, seq_lens, *, page_size, k, sink_pages=1, recent_pages=1, sink_start=None, backend=None,
                 workspace=None):
    """int32 ``[B, Hkv, k]`` ascending logical page ids per (sequence, KV head), -1 padded.
    ``workspace``: a :class:`~kvlocks.selection.triton.SelectWorkspace` (Triton)."""
    backend = resolve_backend(backend, ranking.device)
    if backend == "cpu" and sink_start is None:
        from kvlocks.selection.cpu import select_rows

        bsz, hkv, width = ranking.shape
        lens = seq_lens.long().repeat_interleave(hkv)  # [B*Hkv]
        ids = select_rows(ranking.reshape(bsz * hkv, width), full_pages(lens, page_size), num_pages(lens, page_size),
                          k, sink_pages=sink_pages, recent_pages=recent_pages)
        return ids.view(bsz, hkv, k)
    if backend == "triton":
        from kvlocks.selection.triton import select_pages_paged

        return select_pages_paged(ranking, seq_lens, page_size=page_size, k=k, sink_pages=sink_pages,
                                  recent_pages=recent_pages, sink_start=sink_start, workspace=workspace)
    bsz, hkv, _ = ranking.shape
    out = torch.full((bsz, hkv, k), -1, dtype=torch.int32, device=ranking.device)
    for b in range(bsz):
        n = int(seq_lens[b])
        pc, total = full_pages(n, page_size), num_pages(n, page_size)
        ss = None if sink_start is None else sink_start[b].long().expand(hkv)
        ids = select_top_pages(ranking[b, :, :pc], total, k, sink_pages=sink_pages, recent_pages=recent_pages,
                               sink_start=ss)
        out[b, :, : ids.shape[-1]] = ids.to(torch.int32)
    return out


def paged_decode(queries, k_cache, v_cache, block_table, seq_lens, page_list, *, scale=None, backend=None,
                 workspace=None, options: KernelOptions | None = None, out=None, sparse_lens=None):
    """Attention over the listed pages: ``out [B, Hq, D]`` (queries' dtype), ``lse [B, Hq]`` float32.
    ``workspace``: an :class:`~kvlocks.attention.triton.AttentionWorkspace` (Triton); ``out``: a
    ``[B, Hq, D]`` tensor to write the result into (last dim contiguous); ``sparse_lens``: int32
    ``[B]`` or None, rows whose entry is 0 attend every page instead of their list
    (:meth:`DecodePlan.run`)."""
    if out is not None:
        check_out(out, queries)
    backend = resolve_backend(backend, queries.device)
    if sparse_lens is not None and backend != "triton":  # the kernel reads the block table itself
        page_list = dense_page_lists(page_list, seq_lens, sparse_lens, block_table.shape[1], k_cache.shape[1])
    if backend == "cpu":
        from kvlocks.attention.cpu import paged_decode as cpu_decode

        scale = 1.0 / math.sqrt(queries.shape[-1]) if scale is None else float(scale)
        return cpu_decode(queries, k_cache, v_cache, block_table, seq_lens, page_list, scale=scale, out=out)
    if backend == "triton":
        from kvlocks.attention.triton import paged_decode as tri

        return tri(queries, k_cache, v_cache, block_table, seq_lens, page_list, scale=scale, workspace=workspace,
                   options=options, out=out, sparse_lens=sparse_lens)
    bsz, hq, d = queries.shape
    hkv = k_cache.shape[2]
    g, s = hq // hkv, k_cache.shape[1]
    out = torch.empty_like(queries) if out is None else out
    lse = torch.empty(bsz, hq, device=queries.device)
    for b in range(bsz):
        n = int(seq_lens[b])
        keys = paged_to_token_major(k_cache, block_table[b], n)  # [Hkv, n, D]
        values = paged_to_token_major(v_cache, block_table[b], n)
        ids = page_list[b].long()
        ids = ids[:, : int((ids[0] >= 0).sum())]  # -1 padding is shared by the heads of a sequence
        o, l = ref_sparse_decode(queries[b].view(hkv, g, d), keys, values, ids, s, scale=scale)
        out[b], lse[b] = o.reshape(hq, d).to(out.dtype), l.reshape(hq)
    return out, lse


def paged_build(k_cache, summaries: SummaryStore, page_ids, config: LocksConfig, *, backend=None,
                options: KernelOptions | None = None):
    """Build the summaries of physical pages ``page_ids [N]`` (all KV heads) into ``summaries``."""
    backend = resolve_backend(backend, k_cache.device)
    check_config(config, k_cache.shape[-1], backend="triton" if backend == "triton" else "torch")
    if backend == "triton":
        from kvlocks.summary.triton import build_pages

        return build_pages(k_cache, summaries, page_ids.to(torch.int32),
                           solver=(options or default_kernel_options()).build_solver)
    ids = page_ids.long()
    ids = ids[ids >= 0]
    if ids.numel():
        keys = k_cache.index_select(0, ids).permute(2, 0, 1, 3)  # [Hkv, N, S, D]
        summaries.scatter_(ids, build_summaries(keys, config))


def paged_build_new(k_cache, summaries: SummaryStore, block_table, seq_lens, config: LocksConfig, *,
                    backend=None, options: KernelOptions | None = None):
    """Incremental build: the page each sequence's last token filled (if ``seq_lens % S == 0``)."""
    if resolve_backend(backend, k_cache.device) == "triton":
        from kvlocks.summary.triton import build_new_pages

        return build_new_pages(k_cache, summaries, block_table, seq_lens,
                               solver=(options or default_kernel_options()).build_solver)
    s = k_cache.shape[1]
    filled = (seq_lens > 0) & (seq_lens % s == 0)
    page = (full_pages(seq_lens, s) - 1).clamp_min(0).long()
    phys = block_table.gather(1, page[:, None])[:, 0]
    paged_build(k_cache, summaries, phys[filled], config, backend="torch")


class DecodePlan:
    """Buffers and launch sizes for one decode step of a batch: plan once, ``run`` per layer.

    This is the one composition of a LOCKS decode step (score -> select -> attend) that every path
    runs: the engine, both vLLM backends and the Hugging Face cache (through a paged view of its
    store). ``run`` scores every full page (Eq. 4, or with ``config.rerank_scores == "centroid"``
    from the centroids alone, then the exact re-rank of the candidates), selects
    ``k = config.pages_per_step`` pages per (sequence, KV head) and attends them; ``run_ranked``
    does the select -> attend part from a ranking computed elsewhere (a baseline selector's scores).
    Triton backend: the buffers are owned by the plan, with no allocation and no host
    synchronisation, so a whole step can be captured in a CUDA graph; the score kernel, then the
    combine and the selection fused in one launch (:mod:`kvlocks.selection.fused`), then the
    split-KV attention and its merge. The fused selection was timed against the combine pass and
    the two-launch selection on the H200 (GLM-4-9B shape, batch 1, whole-model TPOT): -1% to -3%
    from 32K to 1M, +0.8% (noise) at 16K (docs/benchmarks.md). Backends ``torch`` (the references,
    per sequence: the spec) and ``cpu`` (batched PyTorch operations for CPU tensors) allocate.

    Parameters
    ----------
    batch, num_kv_heads, group, head_dim : B, Hkv, G, D
    max_pages : width of the block table (pages per sequence at most)
    config : LocksConfig (page_size, budget, sink/recent pages, combine rule; int4/int8 summaries
        except on the ``cpu`` backend with :class:`~kvlocks.scoring.cpu.ScoringBuffers`)
    dtype, device : of the queries and the K/V cache
    backend : one of :data:`PLAN_BACKENDS` or None (:func:`resolve_backend`)
    options : KernelOptions (None: the defaults); the attention's untuned launch is
        ``options.dense_launches[0]`` (:attr:`attend_ws`, which a tuner may replace)
    dense_tokens : the longest row that ``run(..., sparse_lens=...)`` attends over every page, for
        sizing the attention's launch (0: sized for the page lists; longer rows are still attended
        whole, by fewer programs per page)
    """

    def __init__(self, *, batch, num_kv_heads, group, head_dim, max_pages, config: LocksConfig, dtype, device,
                 scale=None, backend=None, options: KernelOptions | None = None, dense_tokens: int = 0):
        self.config, self.backend = config, resolve_backend(backend, device)
        if self.backend != "cpu":  # the cpu backend also scores summaries of any bit widths
            check_config(config, head_dim, backend=self.backend)
        self.options = options or default_kernel_options()
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.k = config.pages_per_step
        self.pages = None
        self.score_ws = self.select_ws = self.attend_ws = self.rerank_ws = self.exact_ws = None
        if self.backend == "triton":
            from kvlocks.attention.triton import attention_workspace
            from kvlocks.scoring.triton import score_workspace
            from kvlocks.selection.fused import fused_workspace

            rows, sized = batch * num_kv_heads, 1 if self.options.batch_invariant else batch
            if config.rerank_scores == "centroid":
                from kvlocks.scoring.triton_centroid import centroid_workspace

                self.score_ws = centroid_workspace(batch, num_kv_heads, group, max_pages, device, split_batch=sized)
            else:
                self.score_ws = score_workspace(batch, num_kv_heads, group, max_pages, device, head_dim=head_dim,
                                                split_batch=sized)
            short = self.options.short_row_pages
            self.select_ws = fused_workspace(batch, num_kv_heads, max_pages, self.k, device, short_pages=short)
            self.attend_ws = attention_workspace(batch, num_kv_heads * group, head_dim, self.k, rows, dtype, device,
                                                 launch=self.options.dense_launches[0],
                                                 dense_pages=num_pages(dense_tokens, config.page_size),
                                                 split_rows=sized * num_kv_heads)
            if config.rerank:  # the fused selection picks the candidates: k' = M + sink + recent pages
                from kvlocks.selection.triton_rerank import rerank_workspace

                self.k_cand = min(max_pages, config.rerank_candidates(max_pages) + config.sink_pages
                                  + config.recent_pages)
                self.rerank_ws = fused_workspace(batch, num_kv_heads, max_pages, self.k_cand, device,
                                                 short_pages=short)
                self.exact_ws = rerank_workspace(batch, num_kv_heads, group, self.k_cand, self.k, device)

    def run(self, queries, k_cache, v_cache, summaries, block_table, seq_lens, out=None, *, summary_table=None,
            sparse_lens=None):
        """queries ``[B, Hq, D]`` -> (out ``[B, Hq, D]``, lse ``[B, Hq]``); also sets ``self.pages``
        (int32 ``[B, Hkv, k]`` logical pages, -1 padded).

        ``out``: where to write the attention (``[B, Hq, D]``, last dim contiguous; default a plan
        buffer). ``summary_table``: int32 ``[B, >= max full pages]``, the physical summary page of
        each logical page where the summaries are numbered apart from the K/V pages (default
        ``block_table``). ``sparse_lens``: int32 ``[B]``, ``seq_lens`` on the rows that decode
        sparsely and 0 on the rows attended over every page (:func:`sparse_lens`): those are
        neither scored nor selected (their ``pages`` are -1) and get exact attention; None: every
        row is scored and selected."""
        c, be, opts = self.config, self.backend, self.options
        centroid = c.rerank_scores == "centroid"
        table_s = block_table if summary_table is None else summary_table
        lens = seq_lens if sparse_lens is None else sparse_lens  # what the scores and the selection see
        if be == "triton":  # score kernel, then combine + selection fused in one launch
            from kvlocks.selection.fused import rank_and_select

            if centroid:
                from kvlocks.scoring.triton_centroid import score_pages_centroid

                score_pages_centroid(queries, summaries, table_s, lens, scale=self.scale, combine=c.combine,
                                     workspace=self.score_ws, rank=False)
            else:
                from kvlocks.scoring.triton import score_pages_paged

                score_pages_paged(queries, summaries, table_s, lens, scale=self.scale, combine=c.combine,
                                  workspace=self.score_ws, rank=False, options=opts)
            if c.rerank:  # the same launch picks the candidates; their exact masses pick the pages
                from kvlocks.selection.triton_rerank import rerank_pages

                cand = rank_and_select(self.score_ws, lens, page_size=c.page_size, k=self.k_cand,
                                       combine=c.combine, sink_pages=c.sink_pages, recent_pages=c.recent_pages,
                                       workspace=self.rerank_ws, options=opts)
                self.pages = rerank_pages(queries, k_cache, block_table, lens, self.score_ws.scores,
                                          self.score_ws.lse, cand, c, scale=self.scale, workspace=self.exact_ws,
                                          options=opts)
            else:
                self.pages = rank_and_select(self.score_ws, lens, page_size=c.page_size, k=self.k,
                                             combine=c.combine, sink_pages=c.sink_pages,
                                             recent_pages=c.recent_pages, workspace=self.select_ws, options=opts)
            return self._attend(queries, k_cache, v_cache, block_table, seq_lens, out, sparse_lens)
        scores, _, ranking = paged_score(queries, summaries, table_s, lens, scale=self.scale,
                                         combine=c.combine, backend=be, centroid=centroid)
        return self.run_ranked(queries, k_cache, v_cache, block_table, seq_lens, ranking, scores=scores, out=out,
                               sparse_lens=sparse_lens)

    def run_ranked(self, queries, k_cache, v_cache, block_table, seq_lens, ranking, *, scores=None, out=None,
                   sparse_lens=None):
        """Select -> attend from a ranking computed elsewhere (e.g. a baseline selector's scores).

        ranking float32 ``[B, Hkv, W]`` (the combined score of each full page; entries past a row's
        full pages are not read); scores float32 ``[B, Hkv, G, W]`` or None: the per-head estimates
        the exact re-rank (``config.rerank``) starts from (None: no re-rank); ``sparse_lens`` as in
        :meth:`run`. Same outputs as :meth:`run`; allocates on every backend (not for CUDA-graph
        capture)."""
        c = self.config
        lens = seq_lens if sparse_lens is None else sparse_lens
        if c.rerank and scores is not None:
            from kvlocks.selection.rerank_paged import paged_rerank

            ranking = paged_rerank(queries, k_cache, block_table, lens, scores, c, scale=self.scale)
        self.pages = paged_select(ranking, lens, page_size=c.page_size, k=self.k, sink_pages=c.sink_pages,
                                  recent_pages=c.recent_pages, backend=self.backend)
        return self._attend(queries, k_cache, v_cache, block_table, seq_lens, out, sparse_lens)

    def _attend(self, queries, k_cache, v_cache, block_table, seq_lens, out, sparse_lens=None):
        return paged_decode(queries, k_cache, v_cache, block_table, seq_lens, self.pages, scale=self.scale,
                            backend=self.backend, workspace=self.attend_ws, options=self.options, out=out,
                            sparse_lens=sparse_lens)
