"""The fastest launch of the split-KV dense decode for one cache, picked by timing every candidate.

The dense baseline must be the fastest dense decode the machine has, and no one launch
configuration of :func:`kvlocks.attention.triton.paged_decode` is fastest everywhere
(``KernelOptions.dense_launches``: on the H200 8 pages per step and 8 warps read a 1M-token
GLM-4-9B layer in 506 us against 597 us for the default 4 pages and 4 warps, while the split
count decides short contexts; docs/benchmarks.md). :func:`fastest_dense` times each candidate on
the caller's own cache, checks its output against the first (default) launch's, and returns the
fastest workspace with every timing.

Timing: one CUDA graph per candidate holding ``reps`` launches that walk the cache's layers in turn
(as a decode step reads them: a layer smaller than the L2 is not re-read from it), replayed
``rounds`` times, the median replay taken; candidates are timed in interleaved rounds so drift
affects all alike.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

import torch

from kvlocks.attention.triton import AttentionWorkspace, attention_workspace, paged_decode
from kvlocks.config import DenseLaunch, KernelOptions, default_kernel_options


def workspace_for(launch: DenseLaunch, *, batch: int, num_q_heads: int, head_dim: int, list_len: int, rows: int,
                  dtype, device) -> AttentionWorkspace:
    """The :func:`paged_decode` workspace of ``launch``."""
    return attention_workspace(batch, num_q_heads, head_dim, list_len, rows, dtype, device, launch=launch)


@dataclasses.dataclass
class TuneResult:
    launch: DenseLaunch
    workspace: AttentionWorkspace
    times_us: dict  # label -> median microseconds per launch (None: failed to launch)
    rejected: dict  # label -> why (launch error, or output differing from the default's)
    default: DenseLaunch  # the reference launch (the candidates' first)

    def describe(self) -> str:
        t = self.times_us[self.launch.label()]
        base = self.times_us.get(self.default.label())
        vs = f", default {base:.1f} us" if base is not None and self.launch != self.default else ""
        return (f"{self.launch.label()} ({self.workspace.splits} splits): {t:.1f} us per layer{vs}; "
                f"fastest of {sum(v is not None for v in self.times_us.values())} launches timed")


def fastest_dense(q: torch.Tensor, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor],
                  block_table: torch.Tensor, seq_lens: torch.Tensor, page_list: torch.Tensor, *,
                  scale: float | None = None, candidates: Sequence[DenseLaunch] | None = None, reps: int = 8,
                  rounds: int = 5, timer: Callable[[Callable[[], None]], float] | None = None,
                  atol: float = 1e-2, rtol: float = 1e-2, options: KernelOptions | None = None) -> TuneResult:
    """Time every candidate launch of :func:`paged_decode` over ``page_list`` and return the fastest.

    Parameters
    ----------
    q : ``[B, Hq, D]`` queries (any values: the kernels' speed does not depend on them)
    k_layers, v_layers : per-layer caches ``[num_pages, S, Hkv, D]`` (one or more layers)
    candidates : launches to time, the first the reference (default: ``options.dense_launches``)
    timer : ``timer(fn) -> seconds`` for one call of ``fn``; default: a CUDA graph of ``reps`` launches
        (CUDA only). Tests pass their own.
    atol, rtol : a candidate whose output differs from the first launch's by more than
        ``atol + rtol |first|`` (the same attention summed in another order differs by the output
        dtype's rounding) is rejected, never chosen.
    options : KernelOptions (None: the defaults); ``pdl`` and, without ``candidates``, ``dense_launches``
    """
    options = options or default_kernel_options()
    candidates = options.dense_launches if candidates is None else tuple(candidates)
    if not candidates:
        raise ValueError("candidates: need at least one DenseLaunch")
    if len(k_layers) != len(v_layers) or not k_layers:
        raise ValueError(f"k_layers / v_layers: need the same number (>= 1), got {len(k_layers)} / {len(v_layers)}")
    bsz, hq, d = q.shape
    hkv = k_layers[0].shape[-2]
    shape = dict(batch=bsz, num_q_heads=hq, head_dim=d, list_len=page_list.shape[-1], rows=bsz * hkv,
                 dtype=q.dtype, device=q.device)
    launches = list(dict.fromkeys(candidates))  # the first: the reference output
    ref = None
    runs, times, rejected, spaces = {}, {}, {}, {}
    for launch in launches:
        ws = workspace_for(launch, **shape)

        def run(ws=ws, layer=0):
            return paged_decode(q, k_layers[layer], v_layers[layer], block_table, seq_lens, page_list, scale=scale,
                                workspace=ws, options=options)

        try:
            out = run()[0].float()
        except Exception as e:  # e.g. out of shared memory on a smaller GPU: that launch is not available
            rejected[launch.label()] = f"launch failed: {type(e).__name__}: {str(e)[:200]}"
            continue
        if ref is None:
            ref = out.clone()
        elif not torch.allclose(out, ref, atol=atol, rtol=rtol):
            rejected[launch.label()] = f"output differs from the default launch's by {float((out - ref).abs().max()):.3g}"
            continue
        runs[launch], spaces[launch] = run, ws
    if not runs:
        raise RuntimeError(f"no dense launch ran: {rejected}")
    time_one = timer or _graph_timer(len(k_layers), reps)
    samples: dict = {launch: [] for launch in runs}
    for _ in range(rounds):
        for launch, run in runs.items():
            samples[launch].append(time_one(run))
    for launch, xs in samples.items():
        times[launch.label()] = statistics.median(xs) * 1e6
    for label in rejected:
        times[label] = None
    best = min(runs, key=lambda launch: times[launch.label()])
    return TuneResult(best, spaces[best], times, rejected, launches[0])


def _graph_timer(layers: int, reps: int) -> Callable:
    """Seconds per launch: ``reps`` launches over the layers in turn, captured once per function."""
    graphs: dict = {}

    def time_one(run) -> float:
        if run not in graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(reps):  # warm-up outside the graph (and compile)
                    run(layer=i % layers)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(reps):
                    run(layer=i % layers)
            graphs[run] = g
        g = graphs[run]
        g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e-3 / reps

    return time_one
