"""The paged LOCKS cache for Hugging Face transformers: :class:`LocksCache` and its layers.

Decode steps run the decode plan (:class:`kvlocks.plan.DecodePlan`, :mod:`.step`) through a paged
view of each layer's store: on CUDA tensors its ``triton`` backend where the kernels support the
configuration (:func:`kvlocks.kernels_support.kernel_support`), otherwise its ``cpu`` backend
(batched PyTorch, any device). Every mode of the configuration (flat, ``rerank``,
``rerank_scores="centroid"``) runs there; other selectors rank the pages their own way and the plan
selects and attends. The token-major references (:func:`~kvlocks.selection.selectors.choose_pages`)
run left-padded batches (a token mask), per-head selectors and ``backend="torch"``.
``LocksCache(..., backend="cpu" | "triton")`` forces a plan backend (tests run ``"triton"`` on the
CPU through ``TRITON_INTERPRET=1``). Hybrid models:
sliding-window layers keep transformers' own window attention, only global layers are sparse
(:mod:`.window`).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlocks.attention.reference import sparse_decode
from kvlocks.cache.paged import PagedLayerStore
from kvlocks.config import METHOD_MODES, KernelOptions, LocksConfig, in_mode, method_config
from kvlocks.integrations.hf.step import StepPlans, plan_backend, plan_decode
from kvlocks.hybrid import layer_windows
from kvlocks.integrations.hf.window import WindowLayer, check_positions, check_sparse
from kvlocks.integrations.hf.stats import DecodeStats
from kvlocks.pages import num_pages
from kvlocks.positions import position_limit
from kvlocks.selection.rerank import DEFAULT_RERANK  # noqa: F401  (re-exported)
from kvlocks.plan import PLAN_BACKENDS
from kvlocks.scoring.cpu import ScoringBuffers
from kvlocks.attention.per_head import distinct_pages, sparse_decode_per_head
from kvlocks.selection.selectors import LayerView, Selector, choose_pages, get_selector, reranks

METHODS = ("full", *METHOD_MODES)  # plus every registered selector name, see method_names()


def method_names() -> tuple[str, ...]:
    from kvlocks.selection.selectors import selector_names
    return tuple(dict.fromkeys(METHODS + selector_names()))


def kernel_path(selector, config: LocksConfig, head_dim: int) -> bool:
    """Whether a decode step of this (selector, config, head_dim) on CUDA tensors runs the plan's
    Triton backend; otherwise the plan's ``cpu`` backend or, for per-head selectors, the references
    (:func:`.step.plan_backend`)."""
    return plan_backend(None, selector, config, head_dim, "cuda") == "triton"


class _LayerStore(PagedLayerStore):
    """A :class:`PagedLayerStore` whose summary builds run the Triton kernel when the cache's
    backend resolves to ``"triton"`` for the keys' device (and the config is the kernels')."""

    def __init__(self, config: LocksConfig, *, build: bool, owner: "LocksCache") -> None:
        super().__init__(config, build=build)
        self.owner = owner
        self.scoring = ScoringBuffers()  # the plan's cpu backend: dequantized summaries

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

        options = self.owner.kernel_options
        return tri_build(pages, self.config, solver=options.build_solver if options is not None else "auto")

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
        self.owner.record(self.layer_idx, key, num_pages(key.shape[2], self.owner.config.page_size))

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
        backend = None if token_mask is not None else self.owner.plan_backend(key)
        if backend is not None:  # the decode plan over a paged view of the store
            return plan_decode(self, q, key, scaling, backend).reshape(b, hq, d).unsqueeze(1)
        view = LayerView(keys=key, summaries=self.store.summaries, token_mask=token_mask, scale=scaling,
                         layer=self.layer_idx)
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
    method : ``"full"`` (dense attention), a selector name (``"locks"``, ``"oracle"``, ...), a mode
        of ``locks`` (``"locks_flat"``, ``"locks_rerank"``, ``"locks_centroid"``:
        :data:`kvlocks.config.METHOD_MODES`) or a selector instance (e.g. ``LokiSelector(calibration)``)
    config : LocksConfig, run as given. None: ``method_config(method)`` (the mode's settings). With
        a mode name the config must be in that mode (ValueError otherwise; build it with
        :func:`kvlocks.config.method_config`)
    backend : ``"torch"`` (the token-major references), ``"cpu"`` or ``"triton"`` (the decode
        plan's backend), or None (the plan: Triton for CUDA tensors where the kernels support the
        configuration, else ``"cpu"``)
    kernel_options : KernelOptions for the plan's Triton backend (None: the defaults)
    """

    def __init__(self, model_config, *, method: "str | Selector" = "locks", config: LocksConfig | None = None,
                 backend: str | None = None, kernel_options: KernelOptions | None = None) -> None:
        if backend is not None and backend not in PLAN_BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed {PLAN_BACKENDS} or None")
        if kernel_options is not None and not isinstance(kernel_options, KernelOptions):
            raise ValueError(f"kernel_options must be a kvlocks.KernelOptions or None, got {type(kernel_options).__name__}")
        self.backend, self.kernel_options = backend, kernel_options
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
        self.config = method_config(method) if config is None else config
        if not in_mode(method, self.config):
            raise ValueError(f"method={method!r} is locks with {METHOD_MODES[method]}, but the config given does not "
                             f"set that mode ({self.config!r}); pass config=kvlocks.config.method_config({method!r}, "
                             f"config) or set the fields yourself")
        self.plans = StepPlans(self.config, kernel_options)
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
        if config is None:  # this cache's config, in the mode a mode name stands for
            config = method_config(method, self.config) if isinstance(method, str) else self.config
        new = type(self).__new__(type(self))  # a subclass forks into its own class ...
        LocksCache.__init__(new, self.model_config, method=method, config=config, backend=self.backend,
                            kernel_options=self.kernel_options)
        for src, dst in zip(self.layers, new.layers):
            dst.copy_from(src)
        self._fork_state(new)  # ... and copies its own state
        return new

    def _fork_state(self, new: "LocksCache") -> None:
        """Hook for subclasses: copy state beyond K/V and summaries into the fork ``new``."""

    def plan_backend(self, keys: torch.Tensor) -> str | None:
        """The decode plan's backend for keys like ``keys [B, Hkv, N, D]`` (None: the references)."""
        return plan_backend(self.backend, self.selector, self.config, keys.shape[-1], keys.device)

    def uses_kernels(self, keys: torch.Tensor | None) -> bool:
        """Whether this cache runs the Triton kernels (summary build, decode plan) for keys like ``keys``."""
        return keys is not None and self.plan_backend(keys) == "triton"

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
        else:  # every page summary
            store = self.layers[layer].store
            per_page = sum(store.summaries.bytes_per_page())
            if self.config.rerank_scores == "centroid":  # the centroids only: int8 and a float16 scale, or float16
                per_page = d * self.config.coef_bits // 8 + 2 * (self.config.coef_bits == 8)
            sel = hkv * (n // s) * per_page
        if self.selector is not None and reranks(self.config, self.selector):
            pc = n // s  # the re-rank reads the keys of its candidates and of the forced full pages
            exact = min(pc, self.config.rerank_candidates(pc) + self.config.sink_pages + self.config.recent_pages)
            sel += hkv * exact * s * d * elem
        self.stats.add(layer, kind="dense" if self.selector is None else "sparse", pages=pages, tokens=tokens,
                       context=n, selection_bytes=sel, kv_bytes=2.0 * hkv * tokens * d * elem, full_bytes=full)
