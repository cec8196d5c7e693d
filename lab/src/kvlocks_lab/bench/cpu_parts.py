"""The parts of one layer's decode attention on the CPU, each timed alone (ms, median of runs).

Run on layer 0 of a prefilled cache, with a query made of that layer's last key repeated over
the GQA group (the values do not change the work). Parts:

- ``full``: transformers' SDPA over every token (what the ``full`` method runs);
- the decode plan's ``cpu`` backend (:mod:`kvlocks.scoring.cpu`, :mod:`kvlocks.selection.cpu`,
  :mod:`kvlocks.attention.cpu`): ``scores`` (Eq. 4 from the dequantized buffers), ``combine``,
  ``select``, ``attend`` (the selected pages gathered from the paged view, two batched products), and
  ``sync_all`` (dequantizing every page into fresh buffers, paid once per fork);
- the references (``_ref``): ``scores`` (:func:`~kvlocks.scoring.reference.score_pages_from_summaries`),
  ``combine``, ``select`` (:func:`~kvlocks.selection.topk.select_top_pages`), ``attend``
  (:func:`~kvlocks.attention.reference.sparse_decode`);
- ``build_page``: building one newly filled page's summaries (all KV heads) and appending them,
  paid once per page per layer, i.e. every ``page_size`` steps.

Parts run cache-warm, so they are a lower bound on the same work inside a model step.
"""

from __future__ import annotations

import statistics
import time

import torch


def _ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def layer_parts(model, cache, method: str) -> dict:
    """``{part: ms}`` for ``method`` (``full``, ``locks``, ``locks_ref``, ``oracle``, ...) on layer 0."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvlocks.attention.reference import sparse_decode
    from kvlocks.attention.cpu import paged_decode
    from kvlocks.scoring.cpu import ScoringBuffers
    from kvlocks.selection.cpu import select_rows
    from kvlocks.scoring.reference import combine_group, exact_page_lse, score_pages_from_summaries
    from kvlocks.selection.topk import select_top_pages
    from kvlocks.summary.build import build_summaries

    layer = cache.layers[0]
    store, config = layer.store, cache.config
    key, value = store.keys, store.values  # [B, Hkv, N, D]
    b, hkv, n, d = key.shape
    module = model.model.layers[0].self_attn
    g = module.num_key_value_groups
    scale = module.scaling
    q = key[:, :, -1:].expand(b, hkv, g, d).contiguous()  # [B, Hkv, G, D]
    s, total, k = config.page_size, -(-n // config.page_size), config.pages_per_step
    if method == "full":
        query = q.reshape(b, hkv * g, 1, d)
        return {"full": _ms(lambda: sdpa_attention_forward(module, query, key, value, None, scaling=scale))}
    base, ref = method.removesuffix("_ref"), method.endswith("_ref")
    parts: dict = {}
    summaries = store.summaries
    if base == "oracle":
        parts["scores"] = _ms(lambda: exact_page_lse(q, key, s, scale=scale))
        scores = exact_page_lse(q, key, s, scale=scale)
    elif ref:
        parts["scores"] = _ms(lambda: score_pages_from_summaries(q, summaries, scale=scale))
        scores = score_pages_from_summaries(q, summaries, scale=scale)
    else:
        buffers = ScoringBuffers()
        parts["sync_all"] = _ms(lambda: ScoringBuffers().sync(summaries), reps=5)
        buffers.sync(summaries)
        qf = q.reshape(b * hkv, g, d)
        parts["scores"] = _ms(lambda: buffers.scores(qf, scale))
        scores = buffers.scores(qf, scale).view(b, hkv, g, -1)
    parts["combine"] = _ms(lambda: combine_group(scores, config.combine))
    ranking = combine_group(scores, config.combine)
    if ref:
        parts["select"] = _ms(lambda: select_top_pages(ranking, total, k, sink_pages=config.sink_pages,
                                                       recent_pages=config.recent_pages))
        pages = select_top_pages(ranking, total, k, sink_pages=config.sink_pages, recent_pages=config.recent_pages)
        parts["attend"] = _ms(lambda: sparse_decode(q, key, value, pages, s, scale=scale))
    else:
        flat = ranking.reshape(b * hkv, -1)
        rows = torch.full((b * hkv,), n)
        sel = lambda: select_rows(flat, rows // s, (rows + s - 1) // s, k, sink_pages=config.sink_pages,
                                  recent_pages=config.recent_pages)
        parts["select"] = _ms(sel)
        pages = sel().view(b * hkv, 1, -1)
        kc, vc, width = store.paged_view()  # one (sequence, KV head) per row
        table = torch.arange(b * hkv * width, dtype=torch.int32).view(b * hkv, width)
        qr = q.reshape(b * hkv, g, d)
        parts["attend"] = _ms(lambda: paged_decode(qr, kc, vc, table, rows, pages, scale=scale))
    if summaries is not None:
        page = key[:, :, (n // s - 1) * s : (n // s) * s].unflatten(2, (1, s))  # [B, Hkv, 1, S, D]
        parts["build_page"] = _ms(lambda: summaries.cat(build_summaries(page, config)))
    parts["total"] = sum(v for p, v in parts.items() if p not in ("sync_all", "build_page"))
    return parts
