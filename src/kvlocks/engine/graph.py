"""Capture a :class:`DecodeStep` in one CUDA graph and replay it (eager on the CPU).

Warm-up runs the step eagerly on a side stream first (Triton compiles its kernels, cuBLAS sets
up its handles), then restores the state it advanced (``tokens``, ``seq_lens``: the K/V it wrote
lies past the restored length and is overwritten later; a page it filled is rebuilt when it fills
again). Capture records the step without running it; each ``replay`` then decodes one token.
"""

from __future__ import annotations

import torch

from kvlocks.engine.step import DecodeStep


class StepRunner:
    """Run a decode step eagerly or as a CUDA-graph replay.

    Parameters
    ----------
    step : DecodeStep
    use_graph : capture a CUDA graph (needs CUDA tensors and the Triton backend)
    warmup : eager steps before capture
    """

    def __init__(self, step: DecodeStep, *, use_graph: bool, warmup: int = 2) -> None:
        self.step, self.graph = step, None
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
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()  # static output: rewritten by every replay

    def __call__(self) -> torch.Tensor:
        """Decode one token per sequence (no host sync on the graph path); returns logits ``[B, V]``."""
        if self.graph is None:
            return self.step()
        self.graph.replay()
        return self.logits
