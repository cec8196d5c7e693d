"""Prefetch a layer's next weights into L2 while its LOCKS selection and attention run.

In a LOCKS decode step at long context, each layer's selection and sparse attention are
latency-bound: they read a few MB in ~30 us (GLM-4-9B at 1M tokens, H200) and leave HBM bandwidth
idle, while the weight products right after them (``o_proj``, then the MLP) are bound by HBM
bandwidth. Here a side stream, forked after the layer's query is ready, issues
``prefetch.global.L2::evict_last`` for the first bytes of those weights (up to a budget below the
L2 size), so the products that follow find them in L2. Prefetches change no value: the step's
results are the same with or without them. Dense decode has no idle phase to fill (its attention
streams the whole K/V at full bandwidth), so this is for the LOCKS step only.

CUDA only; the side stream forks from and joins back into the step's stream, so the step stays
capturable in one CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128  # bytes per prefetch (an L2 line)
LINES_PER_PROGRAM = 1024
L2_FRACTION = 0.5  # default budget per layer: this share of the device's L2


@triton.jit
def _prefetch_kernel(base, n_lines, sink_ptr, LINE: tl.constexpr, PER: tl.constexpr):
    """Prefetch lines ``[pid * PER, (pid + 1) * PER)`` of ``base`` (``n_lines`` lines in all) into L2
    with the evict-last priority; the asm's dummy result goes to ``sink_ptr[pid]`` (kept)."""
    pid = tl.program_id(0)
    i = tl.minimum(pid * PER + tl.arange(0, PER), n_lines - 1)  # past the end: the last line again
    addr = (base + i.to(tl.int64) * LINE).to(tl.int64, bitcast=True)
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + pid, tl.sum(r, axis=0))


def weights_after_attention(layer) -> list[torch.Tensor]:
    """The weights a decoder layer reads after its attention, in order: the output projection, then
    the MLP's linear layers in registration order (``gate_up_proj``, or ``gate_proj`` and ``up_proj``,
    then ``down_proj``)."""
    out = [layer.self_attn.o_proj.weight]
    out += [m.weight for m in layer.mlp.modules() if isinstance(m, torch.nn.Linear)]
    return out


class L2Prefetcher:
    """Per-layer prefetch launches on a side stream.

    Parameters
    ----------
    weights : per layer, the weights to prefetch in order (each contiguous, on one CUDA device)
    budget_bytes : bytes prefetched per layer at most (the leading bytes of the weights, in order);
        None: L2_FRACTION of the device's L2
    """

    def __init__(self, weights: list[list[torch.Tensor]], budget_bytes: int | None = None) -> None:
        dev = weights[0][0].device
        if dev.type != "cuda":
            raise ValueError(f"L2 prefetch needs CUDA weights, got {dev}")
        if budget_bytes is None:
            budget_bytes = int(torch.cuda.get_device_properties(dev).L2_cache_size * L2_FRACTION)
        if budget_bytes < LINE:
            raise ValueError(f"budget_bytes={budget_bytes}: at least one {LINE}-byte line")
        self.plan = []  # per layer: [(uint8 view, lines)]
        for ws in weights:
            left, spans = int(budget_bytes), []
            for w in ws:
                if not w.is_contiguous():
                    raise ValueError("L2 prefetch needs contiguous weights")
                lines = min(w.numel() * w.element_size(), left) // LINE
                if lines > 0:
                    spans.append((w.view(-1).view(torch.uint8), lines))
                    left -= lines * LINE
            self.plan.append(spans)
        self.bytes_per_layer = [sum(n for _, n in spans) * LINE for spans in self.plan]
        most = max((triton.cdiv(n, LINES_PER_PROGRAM) for spans in self.plan for _, n in spans), default=1)
        self.sink = torch.zeros(most, dtype=torch.int32, device=dev)
        self.stream = torch.cuda.Stream(dev)

    def launch(self, layer: int) -> None:
        """Fork from the current stream and prefetch ``layer``'s weights on the side stream."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for w, lines in self.plan[layer]:
                _prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](w, lines, self.sink, LINE=LINE,
                                                                          PER=LINES_PER_PROGRAM, num_warps=4)

    def join(self) -> None:
        """Make the current stream wait for the side stream (before the step ends / a graph closes)."""
        torch.cuda.current_stream().wait_stream(self.stream)
