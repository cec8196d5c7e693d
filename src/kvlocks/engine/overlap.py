"""The summary build overlapped with the dense prefill, so decode does not wait for it.

The prefill runs layer by layer and writes each layer's post-RoPE keys before that layer's
attention; a layer's summaries depend on nothing else. :class:`PrefillBuild` is the prefill's
``after_layer`` hook: on CUDA it queues the build of layer ``l``'s full pages on a side stream as
soon as the prefill has written them (the side stream waits on the prefill's stream, so nothing is
read early), while the prefill itself runs on a high-priority stream (:meth:`prefill_stream`), so
the block scheduler serves the prefill's kernels first and the build fills the gaps they leave.
:meth:`finish` makes the caller's stream wait for every build (no host synchronisation): whatever
is queued after it, the first decode step, sees complete summaries. The time to first token is
that of the dense prefill plus whatever the build takes from it; the benchmark measures both
(``kvlocks bench e2e``: ``ttft_ms`` of each method and ``build_exposed_ms``).

Without CUDA, or with ``overlap=False``, each layer is built inline, in the same order, with the
same result.
"""

from __future__ import annotations

import contextlib

import torch

from kvlocks.config import KernelOptions
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.plan import paged_build


class PrefillBuild:
    """Builds the summaries of every full page of a prompt of ``n_tokens`` tokens, layer by layer.

    Parameters
    ----------
    cache : the :class:`StaticPagedCache` the prefill fills (allocated with summaries)
    n_tokens : prompt length (every sequence); pages ``0 .. n_tokens // S - 1`` of each sequence are built
    backend : ``"triton"`` / ``"torch"`` / None, as for :func:`kvlocks.plan.paged_build`
    overlap : run builds on a side stream (CUDA only; ignored elsewhere)
    options : KernelOptions of the build (None: the defaults)
    """

    def __init__(self, cache: StaticPagedCache, n_tokens: int, *, backend: str | None = None,
                 overlap: bool = True, options: KernelOptions | None = None) -> None:
        if cache.summaries is None:
            raise ValueError("PrefillBuild: the cache was allocated without summaries")
        if not 0 <= n_tokens <= cache.capacity:
            raise ValueError(f"PrefillBuild: n_tokens={n_tokens} outside [0, capacity={cache.capacity}]")
        self.cache, self.backend, self.options = cache, backend, options
        self.ids = cache.block_table[:, : n_tokens // cache.page_size].reshape(-1).contiguous()
        self.built: list[int] = []
        dev = cache.k.device
        self.side = self.high = None
        if overlap and dev.type == "cuda":
            self.side = torch.cuda.Stream(device=dev)  # default (lowest) priority
            self.high = torch.cuda.Stream(device=dev, priority=-1)
            self.ids.record_stream(self.side)

    @property
    def overlapped(self) -> bool:
        return self.side is not None

    @contextlib.contextmanager
    def prefill_stream(self):
        """Run the prefill inside this context: on CUDA it runs on a high-priority stream that
        starts after the caller's stream, and the caller's stream waits for it at exit."""
        if self.high is None:
            yield
            return
        caller = torch.cuda.current_stream(self.high.device)
        self.high.wait_stream(caller)
        with torch.cuda.stream(self.high):
            yield
        caller.wait_stream(self.high)

    def __call__(self, layer: int) -> None:
        """Build ``layer``'s pages (the prefill has written its keys on the current stream)."""
        if not 0 <= layer < self.cache.k.shape[0]:
            raise ValueError(f"PrefillBuild: layer {layer} outside [0, {self.cache.k.shape[0]})")
        self.built.append(layer)
        if self.ids.numel() == 0:
            return
        args = (self.cache.k[layer], self.cache.summaries[layer], self.ids, self.cache.config)
        if self.side is None:
            paged_build(*args, backend=self.backend, options=self.options)
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            paged_build(*args, backend=self.backend, options=self.options)

    def finish(self) -> None:
        """The caller's stream waits for every queued build (call before the first decode step)."""
        missing = sorted(set(range(self.cache.k.shape[0])) - set(self.built))
        if missing:
            raise RuntimeError(f"PrefillBuild.finish: layers {missing} were never built (the prefill did not "
                               f"call the hook for them)")
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
