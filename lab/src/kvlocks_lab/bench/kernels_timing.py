"""Timing for the kernel benchmark (:mod:`kvlocks_lab.bench.kernels`): each method as CUDA-graph
replays timed with CUDA events (wall clock on the CPU), and the device-to-device copy bandwidth the
achieved rates are compared with."""

from __future__ import annotations

import math
import statistics
import time

import torch


def _timer(device):
    """(time_fn) -> microseconds per call: CUDA graph + events on the GPU, wall clock on the CPU."""
    if device.type != "cuda":
        def cpu_time(fn, n_rot, cfg):
            fn(0)
            t0 = time.perf_counter()
            for i in range(n_rot):
                fn(i)
            return (time.perf_counter() - t0) / n_rot * 1e6, None
        return cpu_time

    def ev():
        return torch.cuda.Event(enable_timing=True)

    def gpu_time(fn, n_rot, cfg):
        for i in range(n_rot):  # warm-up: compiles, autotunes, first-touch
            fn(i)
        torch.cuda.synchronize()
        a, b = ev(), ev()
        a.record()
        for i in range(n_rot):
            fn(i)
        b.record()
        b.synchronize()
        eager_us = a.elapsed_time(b) * 1e3 / n_rot
        reps = max(1, math.ceil(cfg.min_graph_ms * 1e3 / max(eager_us * n_rot, 1.0)))
        n_in = min(n_rot * reps, max(n_rot, 2000))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in range(n_in):
                fn(c % n_rot)
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(cfg.replays):
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / n_in)
        del graph
        return statistics.median(times), eager_us
    return gpu_time


def copy_bandwidth(device, nbytes: int = 4 << 30) -> float | None:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written (median of 10)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    times = []
    for _ in range(10):
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9
