"""Compact a whole model's cache of a T-token prefix: every layer and KV head to t entries.

Equal budgets: every (layer, KV head) keeps the same t = ``config.budget(T)`` entries, so the
result is a rectangular cache ``[Hkv, t, D]`` per layer that stock engines can hold
(:class:`~kvlocks.compaction.prefix.CompactedPrefix`).

Hybrid models (Gemma 3): only the global layers are compacted. A sliding-window layer of window
W is read by every later token through its last W - 1 prefix tokens alone, so it keeps exactly
those, as they are (``windows`` says which layers and their window); it is as small as the
stock sliding cache, and exact.

When t == T nothing is dropped, and the exact solution of every method is the prefix cache
itself (beta = 0, values unchanged; nothing to fold). Then the prefill K/V are returned as they
are instead of a numerical fit that would only approximate them; this makes ratio 1.0 a clean
end-to-end check of capture, file and serving.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvlocks.compaction import batched
from kvlocks.compaction.api import compact_layer
from kvlocks.compaction.config import CompactionConfig
from kvlocks.compaction.prefix import CompactedPrefix, identity_layer, model_info
from kvlocks.hybrid import layer_windows

from .capture import Capture, capture_queries, check_prefix_ids
from .passes import ReferenceConfig, reference_passes

logger = logging.getLogger(__name__)


def fit_device(model) -> torch.device:
    """Where the fit runs: the model's device (a GPU when the model is on one), else the CPU."""
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cpu")


FIT_BUDGET_CUDA = 16 * 2**30  # bytes of a chunk's float64 fit matrices on a GPU (at most a quarter of free memory)
_FIT_BYTES_PER_HEAD_ROW_COL = 8 * 6  # float64 [n, t] matrices alive at once in a head's fit (logits, design, weights)


def layer_chunks(capture: Capture, t: int, config: CompactionConfig, device,
                 layers: list[int] | None = None) -> list[list[int]]:
    """Layers whose KV heads are fitted together in one batched fit (consecutive among ``layers``).

    On a GPU a fit of one layer is a few hundred small launches (the bias solve's active-set
    steps, the refits' factorisations) that take about as long for 3 heads as for 90: layers are
    stacked head-wise while their float64 ``[heads, n, t]`` matrices stay within
    ``FIT_BUDGET_CUDA`` (and a quarter of the free memory), and while their logit scales agree.
    On the CPU, and for the per-head methods, one layer at a time. ``layers``: those to fit (all).
    """
    layers = list(range(len(capture.keys))) if layers is None else layers
    if torch.device(device).type != "cuda" or not batched.supports(config) or t == capture.prefix_len:
        return [[i] for i in layers]
    hkv, n = capture.queries[0].shape[0], min(capture.queries[0].shape[1], config.max_queries)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    budget = min(FIT_BUDGET_CUDA, free // 4)
    per_layer = hkv * n * t * _FIT_BYTES_PER_HEAD_ROW_COL
    size = max(1, int(budget // max(per_layer, 1)))
    chunks: list[list[int]] = []
    for i in layers:
        same = chunks and capture.scales[chunks[-1][0]] == capture.scales[i] and len(chunks[-1]) < size
        if same:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def fit_chunk(capture: Capture, chunk: list[int], t: int, config: CompactionConfig, dev,
              timings: dict | None = None) -> list[tuple]:
    """The layers of ``chunk`` compacted by one :func:`~kvlocks.compaction.api.compact_layer` over their stacked KV
    heads (each head's fit is independent: the result is every layer's own; ``timings`` gets its
    stage seconds), split back per layer: ``[(keys, values, beta, indices)]`` on the CPU."""
    hkv = capture.keys[chunk[0]].shape[0]

    def stack(tensors, **to):
        return torch.cat([x.to(dev, **to) for x in tensors])

    k = stack([capture.keys[i] for i in chunk], dtype=torch.float32)
    v = stack([capture.values[i] for i in chunk], dtype=torch.float32)
    q = stack([capture.queries[i] for i in chunk])
    question = None if capture.questions is None else stack([capture.questions[i] for i in chunk])
    try:
        out = compact_layer(k, v, q, t, config, scale=capture.scales[chunk[0]], question=question, timings=timings)
    except ValueError as exc:
        msg = str(exc)
        if msg.startswith("KV head "):  # a stacked head h is layer chunk[h // Hkv], head h % Hkv
            h = int(msg.split()[2].rstrip(":"))
            msg = f"KV head {h % hkv}:" + msg.split(":", 1)[1]
            raise ValueError(f"layer {chunk[h // hkv]}: {msg}") from None
        raise ValueError(f"layer {chunk[0]}" + (f"-{chunk[-1]}" if len(chunk) > 1 else "") + f": {exc}") from None
    parts = [None if x is None else x.cpu().split(hkv) for x in (out.keys, out.values, out.beta, out.indices)]
    return [tuple(None if p is None else p[j] for p in parts) for j in range(len(chunk))]


def compact_capture(model, capture: Capture, config: CompactionConfig, *, t: int | None = None,
                    reference: ReferenceConfig | None = None, model_id: str | None = None,
                    progress: Callable[[str], None] | None = None) -> CompactedPrefix:
    """Compact every layer of a captured prefix with :func:`~kvlocks.compaction.api.compact_layer`.

    Parameters
    ----------
    model : the model the capture came from
    capture : Capture
    config : CompactionConfig
    t : int, optional
        Entries kept per (layer, KV head); default ``config.budget(T)``.
    reference : ReferenceConfig, optional
        Recorded in the result (how the capture's passes were made).
    model_id : str, optional
    progress : callable(str), optional
        Called before each layer, or each chunk of layers fitted together (:func:`layer_chunks`).

    Returns
    -------
    CompactedPrefix
        On the CPU; the fit itself runs on the model's device (:func:`fit_device`).
    """
    if not isinstance(config, CompactionConfig):
        raise ValueError(f"config must be a CompactionConfig, got {type(config).__name__}")
    start = time.perf_counter()
    num = capture.prefix_len
    t = config.budget(num) if t is None else t
    if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= num:
        raise ValueError(f"t={t!r}: must be an integer with 1 <= t <= T={num}")
    dev = fit_device(model)
    windows = layer_windows(model.config)
    fitted: dict[int, tuple] = {i: identity_layer(capture.keys[i], capture.values[i], config.method,
                                                   first=max(0, num - w + 1))
                                for i, w in enumerate(windows) if w is not None}
    for chunk in layer_chunks(capture, t, config, dev, [i for i, w in enumerate(windows) if w is None]):
        if progress is not None:
            span = chunk == list(range(chunk[0], chunk[-1] + 1))
            progress(f"layer {chunk[0]}" if len(chunk) == 1 else
                     f"layers {chunk[0]}-{chunk[-1]}" if span else f"layers {','.join(map(str, chunk))}")
        if t == num:
            fitted.update((i, identity_layer(capture.keys[i], capture.values[i], config.method)) for i in chunk)
        else:
            fitted.update(zip(chunk, fit_chunk(capture, chunk, t, config, dev)))
    keys, values, betas, indices = zip(*(fitted[i] for i in range(len(windows))))
    seconds = capture.seconds + time.perf_counter() - start
    logger.info("compacted T=%d -> t=%d per head with %s in %.1f s", num, t, config.method, seconds)
    return CompactedPrefix(
        keys=keys, values=values, beta=betas if config.method == "am" else None, indices=indices,
        prefix_len=num, kept=t, method=config.method, config=config,
        reference=reference.to_json() if reference is not None else "{}",
        model=model_info(model, model_id), compact_seconds=seconds,
        windows=windows if any(w is not None for w in windows) else None)


def compact_prefix(model, tokenizer, prefix_ids: torch.Tensor, config: CompactionConfig, *,
                   reference: ReferenceConfig | None = None, t: int | None = None,
                   model_id: str | None = None,
                   progress: Callable[[str], None] | None = None) -> CompactedPrefix:
    """Capture reference queries for ``prefix_ids`` [1, T] and compact the model's cache of it.

    Uses ``config.max_queries`` and ``config.seed`` for the query cap and subsample, and the
    passes of ``reference`` (default :class:`~.passes.ReferenceConfig`). See
    :func:`~.capture.capture_queries` and :func:`compact_capture`.
    """
    ids = check_prefix_ids(prefix_ids)
    reference = reference or ReferenceConfig()
    passes = reference_passes(tokenizer, ids, reference)
    capture = capture_queries(model, ids, passes, max_queries=config.max_queries, seed=config.seed,
                              progress=progress)
    return compact_capture(model, capture, config, t=t, reference=reference, model_id=model_id,
                           progress=progress)
