"""Timing and byte accounting of the end-to-end benchmark (:mod:`kvlocks_lab.bench.e2e`): CUDA
events on the GPU, wall clock on the CPU; the device-to-device copy bandwidth; the bytes a decode
step must read."""

from __future__ import annotations

import statistics
import time

import torch

from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.graph import StepRunner
from kvlocks.engine.parts import ModelParts

def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, read + write bytes (median of 10 copies)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        t0 = _now(device)
        dst.copy_(src)
        times.append(_elapsed_s(device, t0))
    return 2 * nbytes / statistics.median(times[1:]) / 1e9


def _now(device):
    if device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _elapsed_s(device, start) -> float:
    if device.type == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3
    return time.perf_counter() - start


def step_bytes(parts: ModelParts, cache: StaticPagedCache, method: str, context: int, config=None) -> dict:
    """Bytes one decode step must read at ``context`` tokens (all layers, all sequences); ``config``:
    the method's LocksConfig (default the cache's). With ``rerank_scores="centroid"`` the selection
    reads every full page's int8 centroid and scale (D + 2 bytes) and the candidates' keys."""
    layers, (hkv, d) = parts.num_layers, cache.k.shape[-2:]
    elem, s = cache.k.element_size(), cache.page_size
    rows = layers * cache.batch * hkv
    w = parts.weight_bytes()
    config = config or cache.config
    if method == "dense":
        kv, summ = rows * 2 * context * d * elem, 0
    else:
        pages = min(config.pages_per_step, -(-context // s))
        kv = rows * 2 * pages * s * d * elem
        full = context // s
        if config.rerank_scores == "centroid":
            cand = min(full, config.rerank_candidates(full) + config.sink_pages + config.recent_pages)
            summ = rows * (full * (d + 2) + cand * s * d * elem)
        else:
            summ = rows * full * cache.summaries[0].bytes_per_page_head()
    return {"weight_bytes": w, "kv_bytes": kv, "summary_bytes": summ, "bytes_per_step": w + kv + summ}


def _time_steps(runner: StepRunner, device, steps: int, warmup: int) -> list[float]:
    """Milliseconds per decode step: ``steps`` replays, each between its own pair of CUDA events."""
    for _ in range(warmup):
        runner()
    if device.type != "cuda":
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            runner()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for a, b in evs:
        a.record()
        runner()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in evs]


def _quantile(xs, q):
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
