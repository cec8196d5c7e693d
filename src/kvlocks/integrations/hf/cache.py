"""The paged LOCKS cache for Hugging Face transformers: :class:`LocksCache` and its layers.

Backends: on CUDA tensors the ``locks`` selector with a configuration the kernels support
(:func:`kernel_path`: :func:`kvlocks.kernels_support.kernel_support`) runs the Triton kernels
(summary build, scoring, combine, selection, paged attention); on CPU tensors the decode step
runs :mod:`kvlocks.integrations.hf.cpu` (the references' pages and attention in fewer, larger
operations); everything else runs the PyTorch references. ``LocksCache(..., backend="torch" |
"triton")`` forces the references or the kernels (tests run ``"triton"`` on the CPU through
``TRITON_INTERPRET=1``). Left-padded batches (a token mask) always take the references: the
kernels' paged layout and the CPU path have no padding; other head dims than the kernels' 64 and
128 (Gemma 3's 256) take the CPU path or the references. Hybrid models: sliding-window layers keep
transformers' own window attention, only global layers are sparse (:mod:`.window`).
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlocks.attention.reference import sparse_decode
from kvlocks.cache.paged import PagedLayerStore
from kvlocks.config import LocksConfig
from kvlocks.integrations.hf.cpu import ScoringBuffers, cpu_decode
from kvlocks.hybrid import layer_windows
from kvlocks.integrations.hf.window import WindowLayer, check_positions, check_sparse
from kvlocks.integrations.hf.stats import DecodeStats
from kvlocks.kernels_support import kernel_support
from kvlocks.pages import num_pages
from kvlocks.positions import position_limit
from kvlocks.selection.hierarchy import DEFAULT_GROUPS, HIER_METHOD
from kvlocks.selection.rerank import DEFAULT_RERANK, RERANK_METHOD
from kvlocks.plan import BACKENDS, resolve_backend
from kvlocks.attention.per_head import distinct_pages, sparse_decode_per_head
from kvlocks.selection.selectors import LayerView, LocksSelector, Selector, choose_pages, get_selector

METHODS = ("full", RERANK_METHOD, HIER_METHOD)  # plus every registered selector name, see method_names()


def method_names() -> tuple[str, ...]:
    from kvlocks.selection.selectors import selector_names
    return METHODS + selector_names()


def kernel_path(selector, config: LocksConfig, head_dim: int) -> bool:
    """Whether the Triton kernels implement this (selector, config, head_dim): the default LOCKS
    selector and a configuration :func:`kvlocks.kernels_support.kernel_support` accepts for them,
    without the exact re-rank (``config.rerank``, which the engine's plan runs) or hierarchical
    scoring (``config.group_pages``). Otherwise the cache runs the PyTorch references (the stated
    fallback)."""
    return isinstance(selector, LocksSelector) and not (config.rerank or config.group_pages) and kernel_support(
        page_size=config.page_size, rank=config.rank, head_dim=head_dim, basis_bits=config.basis_bits,
        coef_bits=config.coef_bits, backend="triton") is None


class _LayerStore(PagedLayerStore):
    """A :class:`PagedLayerStore` whose summary builds run the Triton kernel when the cache's
    backend resolves to ``"triton"`` for the keys' device (and the config is the kernels')."""

    def __init__(self, config: LocksConfig, *, build: bool, owner: "LocksCache") -> None:
        super().__init__(config, build=build)
        self.owner = owner
        self.scoring = ScoringBuffers()  # the CPU path's dequantized summaries (.cpu)

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.scoring = ScoringBuffers()

    def index_batch(self, index: torch.Tensor) -> None:
        super().index_batch(index)
        self.scoring = ScoringBuffers()

    def _summarize(self, pages: torch.Tensor):
        if not self.owner.uses_kernels(self._k):
            return super()._summarize(pages)
        from kvlocks.summary.triton import build_summaries as tri_build

        return tri_build(pages, self.config)

    def _empty(self, config: LocksConfig, build: bool, owner: "LocksCache | None" = None) -> "_LayerStore":
        return _LayerStore(config, build=build, owner=owner or self.owner)


class LocksLayer(DynamicLayer):
    """One layer of a :class:`LocksCache`: paged K/V plus summaries."""

    def __init__(self, owner: "LocksCache", layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.store = _LayerStore(owner.config, build=owner.selector is not None and owner.selector.needs_summaries,
                                 owner=owner)

    @property
    def sparse(self) -> bool:  # decode steps select pages (a selector), else read every page (full)
        return self.owner.selector is not None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_positions(self.owner, self.store.length, key_states.shape[-2])
        self.store.append(key_states, value_states)
        keys, values = self.store.keys, self.store.values
        keys._kvlocks_layer = self  # lets the attention function find this layer, no global state
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        return self.store.length

    def count_dense(self, key: torch.Tensor) -> None:
        """Count a dense decode step over ``key [B, Hkv, N, D]`` (every page read)."""
        self.owner.record(self.layer_idx, key, -(-key.shape[2] // self.owner.config.page_size))

    def copy_from(self, src: "LocksLayer") -> None:
        """Take an independent copy of ``src``'s K/V (a fork; summaries reused when settings match)."""
        self.store = src.store.fork(self.owner.config, build=self.store.build, owner=self.owner)
        if self.store.length:
            self.lazy_initialization(self.store.keys, self.store.values)
            self.keys, self.values = self.store.keys, self.store.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop expects a negative number of tokens to remove")
        if tokens_to_remove:
            self.store.truncate(self.store.length + tokens_to_remove)
            self.keys, self.values = self.store.keys, self.store.values

    def _index(self, index: torch.Tensor) -> None:
        self.store.index_batch(index)
        if self.store.length:
            self.keys, self.values = self.store.keys, self.store.values

    def reorder_cache(self, beam_idx):
        self._index(beam_idx)

    def batch_select_indices(self, indices):
        self._index(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int):
        if self.store.length:
            b = self.store.keys.shape[0]
            self._index(torch.arange(b).repeat_interleave(repeats))

    def reset(self) -> None:
        self.store = _LayerStore(self.owner.config, build=self.store.build, owner=self.owner)
        super().reset()

    def decode(self, query, key, value, attention_mask, scaling):
        """LOCKS decode step: query ``[B, Hq, 1, D]`` -> attention output ``[B, 1, Hq, D]``."""
        b, hq, _, d = query.shape
        hkv = key.shape[1]
        q = query[:, :, 0, :].reshape(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
        token_mask = _token_mask(attention_mask, key)
        if token_mask is None and self.owner.uses_kernels(key):
            out = _kernel_decode(q, key, value, self.store.summaries, self.owner.config, scaling)
            self.owner.record(self.layer_idx, key, min(self.owner.config.pages_per_step,
                                                       -(-key.shape[2] // self.owner.config.page_size)))
            return out.reshape(b, hq, d).unsqueeze(1)
        if token_mask is None and self.owner.backend is None and key.device.type == "cpu":
            out = cpu_decode(self, q, key, value, scaling)
            if out is not None:
                return out.reshape(b, hq, d).unsqueeze(1)
        view = LayerView(keys=key, summaries=self.store.summaries, token_mask=token_mask, scale=scaling,
                         layer=self.layer_idx, groups=self.store.groups)
        pages = choose_pages(q, view, self.owner.config, self.owner.selector)  # [B, Hkv, K] ([B, Hkv, G, K] per head)
        s = self.owner.config.page_size
        if getattr(self.owner.selector, "per_head", False):  # each query head reads its own pages
            out, _ = sparse_decode_per_head(q, key, value, pages, s, scale=scaling, token_mask=token_mask)
            read = distinct_pages(pages, num_pages(key.shape[2], s))
        else:
            out, _ = sparse_decode(q, key, value, pages, s, scale=scaling, token_mask=token_mask)
            read = pages.shape[-1]
        self.owner.record(self.layer_idx, key, read)
        return out.reshape(b, hq, d).unsqueeze(1)


def _kernel_decode(q, key, value, summaries, config: LocksConfig, scale: float) -> torch.Tensor:
    """The LOCKS decode step on the Triton kernels, same result as the reference path.

    q ``[B, Hkv, G, D]``; key/value ``[B, Hkv, N, D]`` views of the page-aligned store; summaries
    of the ``N // S`` full pages (leading dims ``[B, Hkv]``). Returns ``[B, Hkv, G, D]``.
    """
    from kvlocks.attention.triton import sparse_decode as tri_attend
    from kvlocks.scoring.triton import combine_group, score_pages_from_summaries
    from kvlocks.selection.triton import select_top_pages

    s, n = config.page_size, key.shape[2]
    pc, total = n // s, -(-n // s)
    if pc == 0:  # no full page yet: every page is forced (sink and recent)
        pages = torch.arange(min(total, config.pages_per_step), device=q.device).expand(*q.shape[:2], -1)
    else:
        scores = score_pages_from_summaries(q, summaries, scale=scale)  # [B, Hkv, G, Pc]
        ranking = combine_group(scores, config.combine)  # [B, Hkv, Pc]
        ranking = torch.where(torch.isneginf(scores).all(dim=-2), float("-inf"), ranking)
        pages = select_top_pages(ranking, total, config.pages_per_step, sink_pages=config.sink_pages,
                                 recent_pages=config.recent_pages)  # [B, Hkv, K] int64 ascending
    paged = _paged_view(key, value, s)
    if paged is None:  # not a page-aligned store view: the adapter copies K/V into pages
        return tri_attend(q, key, value, pages, s, scale=scale)[0]
    from kvlocks.plan import paged_decode

    kc, vc, table = paged
    rows = table.shape[0]  # B * Hkv sequences of one KV head each
    seq = torch.full((rows,), n, dtype=torch.int32, device=q.device)
    plist = pages.reshape(rows, 1, -1).to(torch.int32)
    out, _ = paged_decode(q.reshape(rows, q.shape[2], q.shape[3]), kc, vc, table, seq, plist, scale=scale,
                          backend="triton")
    return out.view(q.shape)


def _paged_view(key, value, s: int):
    """Zero-copy paged view of the store's ``[B, Hkv, N, D]`` slices of ``[B, Hkv, cap, D]``
    buffers: caches ``[B * Hkv * cap / S, S, 1, D]`` and the block table ``[B * Hkv, P]``
    (row ``b * Hkv + h`` is one sequence with one KV head). None when the strides do not allow it."""
    b, hkv, n, d = key.shape
    st = key.stride()
    if value.stride() != st or st[3] != 1 or st[2] != d or st[1] % (s * d) or st[0] != hkv * st[1]:
        return None
    per_row = st[1] // (s * d)  # pages per (sequence, head) row of the buffer
    shape, strides = (b * hkv * per_row, s, 1, d), (s * d, d, d, 1)
    kc = key.as_strided(shape, strides, key.storage_offset())
    vc = value.as_strided(shape, strides, value.storage_offset())
    p = -(-n // s)
    rows = torch.arange(b * hkv, device=key.device, dtype=torch.int32)[:, None] * per_row
    return kc, vc, rows + torch.arange(p, device=key.device, dtype=torch.int32)[None, :]


def _token_mask(attention_mask, key) -> torch.Tensor | None:
    """Bool ``[B, Hkv, N]`` (True = real token) from transformers' 4-D decode mask, or None."""
    if attention_mask is None:
        return None
    m = attention_mask[:, 0, -1, : key.shape[2]]  # [B, N]
    m = m if m.dtype == torch.bool else m == 0
    if bool(m.all()):
        return None
    return m.unsqueeze(1).expand(-1, key.shape[1], -1)


class LocksCache(Cache):
    """A transformers ``Cache`` that stores K/V in pages and keeps LOCKS summaries.

    Parameters
    ----------
    model_config : the model's ``PretrainedConfig`` (for the number of layers)
    method : ``"full"`` (dense attention), a selector name (``"locks"``, ``"oracle"``, ...),
        ``"locks_rerank"`` (``locks`` with the exact re-rank: ``config.rerank``, or 4 when it is 0) or a
        selector instance (e.g. ``LokiSelector(calibration)``, ``QuestSelector(bits=8)``)
    config : LocksConfig
    backend : ``"torch"`` (the references), ``"triton"`` or None (Triton for CUDA tensors when
        :func:`kernel_path` holds, :mod:`kvlocks.integrations.hf.cpu` for CPU tensors, the
        references otherwise)
    """

    def __init__(self, model_config, *, method: "str | Selector" = "locks", config: LocksConfig | None = None,
                 backend: str | None = None) -> None:
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed {BACKENDS} or None")
        self.backend = backend
        if isinstance(method, str):
            if method not in method_names():
                raise ValueError(f"method={method!r}: allowed {method_names()}")
            self.selector = None if method == "full" else get_selector("locks" if method in METHODS else method)
        elif callable(getattr(method, "page_scores", None)):
            self.selector = method
            method = method.name
        else:
            raise ValueError(f"method={method!r}: allowed {method_names()} or a selector instance")
        self.method = method
        self.config = config or LocksConfig()
        if method == RERANK_METHOD and not self.config.rerank:
            self.config = dataclasses.replace(self.config, rerank=DEFAULT_RERANK)
        for field, value in getattr(self.selector, "config_defaults", {}).items():  # e.g. its candidates
            if getattr(self.config, field) == LocksConfig.__dataclass_fields__[field].default:
                self.config = dataclasses.replace(self.config, **{field: value})
        if method == HIER_METHOD and not self.config.group_pages:
            self.config = dataclasses.replace(self.config, **DEFAULT_GROUPS)
        self.stats = DecodeStats()
        self.model_config = model_config
        self.positions = position_limit(model_config)
        check_sparse(model_config, self.selector, method)
        windows = layer_windows(model_config)  # None: a global layer; else a sliding layer's window
        super().__init__(layers=[LocksLayer(self, i) if w is None else WindowLayer(self, i, w)
                                 for i, w in enumerate(windows)])

    def fork(self, *, method: "str | Selector | None" = None, config: LocksConfig | None = None) -> "LocksCache":
        """An independent copy of this cache's K/V for another method or config.

        Used to decode every method from one shared prefill. Summaries are reused when their
        settings match and rebuilt otherwise; the copy's byte accounting starts at zero.
        """
        if method is None:
            method = self.method if self.method in METHODS else (self.selector or "full")
        new = type(self).__new__(type(self))  # a subclass forks into its own class ...
        LocksCache.__init__(new, self.model_config, method=method, config=config or self.config,
                            backend=self.backend)
        for src, dst in zip(self.layers, new.layers):
            dst.copy_from(src)
        self._fork_state(new)  # ... and copies its own state
        return new

    def _fork_state(self, new: "LocksCache") -> None:
        """Hook for subclasses: copy state beyond K/V and summaries into the fork ``new``."""

    def uses_kernels(self, keys: torch.Tensor | None) -> bool:
        """Whether this cache runs the Triton kernels for keys like ``keys [B, Hkv, N, D]``."""
        if keys is None or not kernel_path(self.selector, self.config, keys.shape[-1]):
            return False
        return resolve_backend(self.backend, keys.device) == "triton"

    def record(self, layer: int, key: torch.Tensor, pages: float) -> None:
        """Add one layer's decode step to the byte accounting (per sequence, all KV heads).

        ``pages``: pages read per KV head (for a per-head selector, the mean number of distinct
        pages its G query heads select).
        """
        hkv, n, d = key.shape[1], key.shape[2], key.shape[3]
        s = self.config.page_size
        total = num_pages(n, s)
        last = n - (total - 1) * s
        tokens = n if pages >= total else (pages - 1) * s + last
        elem = key.element_size()
        full = 2.0 * hkv * n * d * elem
        if self.selector is None:
            sel = 0.0
        elif self.selector.reads_all_keys:
            sel = hkv * n * d * elem
        elif hasattr(self.selector, "selection_bytes"):  # a baseline with its own resident summary
            sel = hkv * self.selector.selection_bytes(self.config, d, elem, n // s)
        elif self.layers[layer].store.summaries is None:  # no full page yet: nothing to score
            sel = 0.0
        else:  # every page summary; hierarchical: every group summary and the candidates' page summaries
            store, read, groups = self.layers[layer].store, n // s, 0
            if self.config.group_pages and isinstance(self.selector, LocksSelector) and store.groups is not None:
                ng, m = store.groups.num_pages, self.config.group_pages
                read += (self.config.groups_kept(ng) - ng) * m  # the unkept groups' pages are not read
                groups = ng * sum(store.groups.bytes_per_page())
            sel = hkv * (read * sum(store.summaries.bytes_per_page()) + groups)
        if self.selector is not None and self.config.rerank and not self.selector.reads_all_keys:
            pc = n // s  # the re-rank reads the keys of its candidates and of the forced full pages
            exact = min(pc, self.config.rerank_candidates(pc) + self.config.sink_pages + self.config.recent_pages)
            sel += hkv * exact * s * d * elem
        self.stats.add(layer, kind="dense" if self.selector is None else "sparse", pages=pages, tokens=tokens,
                       context=n, selection_bytes=sel, kv_bytes=2.0 * hkv * tokens * d * elem, full_bytes=full)
