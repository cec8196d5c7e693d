"""DecodeEngine: dense prefill, summary build, then CUDA-graph decode steps of a HF decoder.

Usage::

    model, tok = kvlocks.models.load("smollm2-135m", device="cuda")
    eng = DecodeEngine(model, EngineConfig(method="locks", locks=LocksConfig(budget=256), max_context=8192))
    tokens = eng.generate(input_ids, max_new_tokens=64)      # [B, 64] greedy tokens

The pieces are separate so benchmarks can time them: :func:`prefill` (or
:meth:`StaticPagedCache.random_fill`), :meth:`StaticPagedCache.build`, :class:`DecodeStep` and
:class:`StepRunner`.
"""

from __future__ import annotations

import contextlib

import torch

from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.config import EngineConfig, auto_min_context_for
from kvlocks.engine.graph import StepRunner
from kvlocks.engine.overlap import PrefillBuild
from kvlocks.engine.parts import model_parts
from kvlocks.engine.prefill import prefill
from kvlocks.positions import check_context, position_limit
from kvlocks.engine.step import DecodeStep
from kvlocks.kernels_support import check_config
from kvlocks.plan import resolve_backend


class DecodeEngine:
    """Greedy decoding of one batch of equal-length prompts on a static paged cache.

    Parameters
    ----------
    model : a supported Hugging Face ``*ForCausalLM`` (see :mod:`kvlocks.engine.parts`), on its device
    config : EngineConfig
    """

    def __init__(self, model, config: EngineConfig) -> None:
        self.config = config
        self.parts = model_parts(model)
        self.positions = position_limit(model.config)  # prompts + new tokens must fit
        p = self.parts
        self.backend = resolve_backend(config.backend, p.device)
        check_config(config.locks, p.head_dim, backend=self.backend, owner="EngineConfig.locks")
        graph = config.cuda_graph
        self.use_graph = (self.backend == "triton" and p.device.type == "cuda") if graph is None else graph
        self.cache = StaticPagedCache(
            layers=p.num_layers, batch=config.batch, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
            max_context=config.max_context, config=config.locks, dtype=p.dtype, device=p.device,
            summaries=config.method != "dense",
        )
        # method="auto": the context from which LOCKS decodes (the config's, or from the model's shape)
        self.auto_min_context = config.auto_min_context
        if self.auto_min_context is None:
            self.auto_min_context = auto_min_context_for(p.num_kv_heads, p.head_dim, p.dtype.itemsize,
                                                         config.locks.page_size)
        self._steps: dict[str, DecodeStep] = {}
        self._runners: dict[str, StepRunner] = {}
        self.runner: StepRunner | None = None
        self.build_in_flight: PrefillBuild | None = None
        # the method decoding now; "auto" picks one at each prefill (dense until then)
        self.method = "dense" if config.method == "auto" else config.method
        self._use(self.method)

    def _use(self, method: str) -> None:
        """Make ``method``'s decode step (and its CUDA graph, once captured) the current one."""
        if method not in self._steps:
            self._steps[method] = DecodeStep(self.parts, self.cache, method=method, backend=self.backend,
                                             compile=self.config.compile, options=self.config.kernels)
        self.method, self.step = method, self._steps[method]
        self.runner = self._runners.get(method)

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Dense prefill of ``input_ids [B, T]`` and (locks) the summaries of every full page, built
        layer by layer during the prefill (overlapped on CUDA; :mod:`kvlocks.engine.overlap`). Sets
        the first token to feed to the prefill's greedy token; returns logits ``[B, V]``. The first
        :meth:`decode` step waits for the builds on the device, not the host. With ``method="auto"``
        the prompt's length picks LOCKS or dense for the decode steps that follow."""
        if self.config.method == "auto":
            self._use("locks" if input_ids.shape[1] >= self.auto_min_context else "dense")
        build = None
        if self.method == "locks":
            build = PrefillBuild(self.cache, input_ids.shape[1], backend=self.backend,
                                 overlap=self.config.overlap_build, options=self.config.kernels)
        with build.prefill_stream() if build is not None else contextlib.nullcontext():
            logits = prefill(self.parts, self.cache, input_ids, chunk=self.config.prefill_chunk, after_layer=build)
        self.step.tokens.copy_(logits.argmax(dim=-1))
        self.build_in_flight = build
        return logits

    def decode(self, steps: int) -> torch.Tensor:
        """``steps`` decode steps from the current state; int64 ``[B, steps]`` of the tokens they pick.
        With ``method="auto"``, a dense decode whose context reaches ``auto_min_context`` switches to
        LOCKS at that step: the summaries of every full page are built then (once, in line), and the
        steps after it run LOCKS's step (and graph)."""
        room = self.cache.capacity - self.cache.length
        if steps > room:
            raise ValueError(f"{steps} decode steps do not fit: the cache has room for {room} more tokens")
        if self.build_in_flight is not None:
            self.build_in_flight.finish()
            self.build_in_flight = None
        out = torch.empty(self.cache.batch, steps, dtype=torch.long, device=self.parts.device)
        for i in range(steps):
            if self._reaches_auto_threshold():
                self._switch_to_locks()
            if self.runner is None:  # first step of this method: pick its launches, then capture
                if self.config.tune_attention:
                    self.step.attn.tune()
                self.runner = self._runners[self.method] = StepRunner(self.step, use_graph=self.use_graph)
            self.runner()  # advances cache.length
            out[:, i].copy_(self.step.tokens)
        return out

    def _reaches_auto_threshold(self) -> bool:
        return (self.config.method == "auto" and self.method == "dense"
                and self.cache.length >= self.auto_min_context)

    def _switch_to_locks(self) -> None:
        """auto, mid-decode: build every full page's summaries, then decode with LOCKS (same token
        to feed: the step objects share the cache, and the next token moves over)."""
        tokens = self.step.tokens
        self.cache.build(backend=self.backend, options=self.config.kernels)
        self._use("locks")
        self.step.tokens.copy_(tokens)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, *, max_new_tokens: int) -> torch.Tensor:
        """Greedy tokens ``[B, max_new_tokens]`` after the prompt (no EOS stop; int64, on the CPU)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        check_context(input_ids.shape[1], max_new_tokens, self.positions)
        if input_ids.shape[1] + max_new_tokens > self.cache.capacity:
            raise ValueError(f"prompt {input_ids.shape[1]} + {max_new_tokens} new tokens exceed max_context="
                             f"{self.config.max_context}")
        self.prefill(input_ids)
        first = self.step.tokens.clone().unsqueeze(1)
        if max_new_tokens == 1:
            return first.cpu()
        return torch.cat([first, self.decode(max_new_tokens - 1)], dim=1).cpu()
