"""Capture a :class:`DecodeStep` in CUDA graphs and replay them (eager on the CPU).

Warm-up runs the step eagerly on a side stream first (Triton compiles its kernels, cuBLAS sets
up its handles), then restores the state it advanced (``tokens``, ``seq_lens``: the K/V it wrote
lies past the restored length and is overwritten later; a page it filled is rebuilt when it fills
again). Capture records the step without running it; each ``replay`` then decodes one token.

LOCKS captures the step twice: with the incremental summary builds (one launch per layer) and
without them. Every sequence has the cache's common length, which the host tracks
(``cache.length``, advanced here by each step), so the host knows which steps fill a page: those
replay the first graph, the other 15 of every 16 the second (eager: the step without the build
launches). Both compute the same tokens; the second leaves out launches that would find nothing to
build. H200, GLM-4-9B, median TPOT with a build launch on every step -> two graphs: 1M 11.82 ->
11.73 ms, 256K 8.68 -> 8.62, 32K 7.81 -> 7.70 (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from kvlocks.engine.step import DecodeStep


class StepRunner:
    """Run a decode step eagerly or as CUDA-graph replays, one token per call.

    Parameters
    ----------
    step : DecodeStep; its cache's ``length`` must be the sequences' current (common) length, and
        each call advances it by one
    use_graph : capture CUDA graphs (needs CUDA tensors and the Triton backend)
    warmup : eager steps before capture
    """

    def __init__(self, step: DecodeStep, *, use_graph: bool, warmup: int = 2) -> None:
        self.step, self.graphs = step, {}
        self.locks = step.attn.name == "locks"
        if not use_graph:
            return
        if step.cache.k.device.type != "cuda" or step.backend != "triton":
            raise ValueError("a CUDA graph needs CUDA tensors and the triton backend")
        state = (step.tokens.clone(), step.cache.seq_lens.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                step()
        torch.cuda.current_stream().wait_stream(side)
        step.tokens.copy_(state[0])
        step.cache.seq_lens.copy_(state[1])
        torch.cuda.synchronize()
        for build in (True, False) if self.locks else (False,):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step(build=build)  # static output: rewritten by every replay of this graph
            self.graphs[build] = (graph, logits)

    def __call__(self) -> torch.Tensor:
        """Decode one token per sequence (no host sync on the graph path); returns logits ``[B, V]``."""
        cache = self.step.cache
        build = self.step.fills_page(cache.length)  # always False for dense
        if self.graphs:
            graph, logits = self.graphs[build]
            graph.replay()
        else:
            logits = self.step(build=build)
        cache.length += 1
        return logits
