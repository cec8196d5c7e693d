"""GPU time per kernel class from a ``torch.profiler`` run: what a decode step spends on page
scoring, selection, attention, weight products and the rest.

Kernels are classed by name (first match wins, lower-case substrings): kvlocks' Triton and CUDA
kernels by their function names, vLLM's FlashAttention 3 by ``flash``, weight products by the
names cuBLAS, CUTLASS and Inductor give them. Everything else (norms, RoPE, elementwise, copies,
sampling) is ``other``.
"""

from __future__ import annotations

from collections import defaultdict

CLASSES = (
    ("kv_write", ("reshape_and_cache",)),  # vLLM's cache write (its name says "flash": before flash_attn)
    ("flash_attn", ("flash",)),  # vLLM's FlashAttention 3 forward and its split combine
    ("locks_score", ("_score_", "score_kernel")),  # Triton kernels; the CUDA kernel (score_mma.cu)
    ("locks_combine", ("_combine_kernel",)),
    ("locks_select", ("_rank_select_kernel", "_chunk_kernel")),  # fused combine + selection; the unfused pass
    ("locks_rerank", ("_exact_kernel", "_pick_kernel")),  # the exact re-rank
    ("locks_build", ("_build_kernel", "_mark_new_kernel", "_note_writes_kernel")),  # summaries and their tags
    ("attend", ("_attn_kernel", "_merge_kernel")),
    ("weights_gemm", ("gemv", "gemm", "cutlass", "xmma", "sm90_", "sm80_", "cublas", "splitk", "nvjet")),
)


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def kernel_times(prof) -> dict[str, list]:
    """``{kernel name (first 120 chars): [total µs, launches]}`` of a finished ``torch.profiler``."""
    import torch

    out: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        k = out[ev.name[:120]]
        k[0] += us
        k[1] += 1
    return dict(out)


def per_step(long: dict, short: dict, steps: int) -> dict[str, list]:
    """Kernel times of ``steps`` extra decode steps: a run that decoded ``steps`` more tokens than
    another (same prompts) minus that run, per kernel, divided by ``steps``."""
    names = set(long) | set(short)
    out = {}
    for n in names:
        t = (long.get(n, [0.0, 0])[0] - short.get(n, [0.0, 0])[0]) / steps
        c = (long.get(n, [0.0, 0])[1] - short.get(n, [0.0, 0])[1]) / steps
        if c > 0 or t > 0:
            out[n] = [t, c]
    return out


def summarize(kernels: dict[str, list], top: int = 25) -> dict:
    """Per-class µs and launches, the kernel sum, and the ``top`` kernels by time."""
    classes: dict = defaultdict(lambda: [0.0, 0.0])
    for n, (t, c) in kernels.items():
        cl = classes[classify(n)]
        cl[0] += t
        cl[1] += c
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_sum_us": sum(t for t, _ in kernels.values()),
            "launches": sum(c for _, c in kernels.values()),
            "classes_us": {k: round(v[0], 2) for k, v in sorted(classes.items())},
            "classes_launches": {k: round(v[1], 2) for k, v in sorted(classes.items())},
            "top_kernels": [{"name": n, "us": round(t, 2), "launches": round(c, 2)} for n, (t, c) in ranked]}
