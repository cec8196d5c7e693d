"""The kernel bench's rows for ``locks_centroid`` (``LocksConfig.rerank_scores = "centroid"``): the
centroid score kernel alone (:mod:`kvlocks.scoring.triton_centroid`) and the whole step of
:class:`kvlocks.plan.DecodePlan` at each candidate multiple, with the bytes each must read; at the
largest context also the step's launches one by one at the multiple ``PARTS_MULTIPLE``
(``x_centroid_c8_select``: the fused selection of the candidates from the centroid scores, and
``x_centroid_c8_select_chunkN`` the same with N pages per program instead of the default;
``x_centroid_c8_exact``: their exact masses; ``x_centroid_c8_pick`` / ``x_centroid_c8_pick_sort``:
the combine and top-k by the radix threshold or by two sorts), each on the inputs the step before
it produced."""

from __future__ import annotations

import dataclasses

import torch

CENTROID_MULTIPLES = (16, 8, 6, 4)  # the locks_centroid candidate multiples measured at every context
PARTS_MULTIPLE = 8  # the multiple whose launches are timed one by one
SELECT_CHUNKS = (2048, 4096, 8192, 16384)  # fused-selection chunk sizes timed beside the default


def centroid_bytes(case, rows, select, attend) -> dict:
    """locks_centroid: the int8 centroids and their
    float16 scales, the fused selection's per-head scores, the candidates' keys, the attention."""
    cen = rows * case.p * (case.d + 2)
    out = {"centroid_score": cen}
    for m in CENTROID_MULTIPLES:
        c = dataclasses.replace(case.lcfg, rerank=m)
        cand = min(case.p, c.rerank_candidates(case.p) + c.sink_pages + c.recent_pages)
        out[f"centroid_c{m}_total"] = cen + select + rows * cand * case.lcfg.page_size * case.d * 2 + attend
        if m == PARTS_MULTIPLE:
            per_head = rows * cand * case.g * 4  # float32 per head and candidate
            out.update({f"x_centroid_c{m}_select_chunk{n}": select for n in SELECT_CHUNKS})
            out.update({f"x_centroid_c{m}_select": select, f"x_centroid_c{m}_pick": 3 * per_head,
                        f"x_centroid_c{m}_pick_sort": 3 * per_head,
                        f"x_centroid_c{m}_exact": rows * cand * case.lcfg.page_size * case.d * 2 + per_head})
    return out


def centroid_methods(case, device) -> dict:
    """The centroid score kernel alone and the locks_centroid step at each candidate multiple."""
    from kvlocks.plan import DecodePlan
    from kvlocks.scoring.triton_centroid import centroid_workspace, score_pages_centroid

    ws = centroid_workspace(case.bsz, case.hkv, case.g, case.p, device)
    plans = {m: DecodePlan(batch=case.bsz, num_kv_heads=case.hkv, group=case.g, head_dim=case.d, max_pages=case.p,
                           config=dataclasses.replace(case.lcfg, rerank=m, rerank_scores="centroid"),
                           dtype=torch.bfloat16, device=device, backend="triton") for m in CENTROID_MULTIPLES}
    return {
        "centroid_score": lambda r: score_pages_centroid(case.q[r], case.store, case.tables[r], case.seq,
                                                         workspace=ws, rank=False),
        **{f"centroid_c{m}_total": (lambda r, pl=pl: pl.run(case.q[r], case.kc, case.vc, case.store, case.tables[r],
                                                            case.seq)) for m, pl in plans.items()},
    }


def centroid_parts(case, device) -> dict:
    """The launches of the locks_centroid step at ``PARTS_MULTIPLE`` one by one (rotation ``r``'s
    inputs are the outputs of the launches before, computed once here)."""
    from kvlocks.plan import DecodePlan
    from kvlocks.selection.fused import fused_workspace, rank_and_select
    from kvlocks.selection.triton_rerank import exact_masses, pick_pages

    c = dataclasses.replace(case.lcfg, rerank=PARTS_MULTIPLE, rerank_scores="centroid")
    plan = DecodePlan(batch=case.bsz, num_kv_heads=case.hkv, group=case.g, head_dim=case.d, max_pages=case.p,
                      config=c, dtype=torch.bfloat16, device=device, backend="triton")
    sel = dict(page_size=c.page_size, k=plan.k_cand, combine=c.combine, sink_pages=c.sink_pages,
               recent_pages=c.recent_pages, workspace=plan.rerank_ws)
    inputs = []
    for r in range(case.n_rot):
        plan.run(case.q[r], case.kc, case.vc, case.store, case.tables[r], case.seq)
        sw, ew = plan.score_ws, plan.exact_ws
        inputs.append((dataclasses.replace(sw, **{n: getattr(sw, n).clone() for n in ("scores", "stats", "lse",
                                                                                      "ranking")}),
                       plan.rerank_ws.out.clone(),
                       dataclasses.replace(ew, exact=ew.exact.clone(), est=ew.est.clone(), out=ew.out.clone())))
    m = PARTS_MULTIPLE

    def exact(r):
        sw, cand, ew = inputs[r]
        exact_masses(case.q[r], case.kc, case.tables[r], case.seq, sw.scores, cand, ew, scale=plan.scale)

    chunked = {n: dict(sel, workspace=fused_workspace(case.bsz, case.hkv, case.p, plan.k_cand, device, chunk=n))
               for n in SELECT_CHUNKS}
    return {
        f"x_centroid_c{m}_select": lambda r: rank_and_select(inputs[r][0], case.seq, **sel),
        **{f"x_centroid_c{m}_select_chunk{n}": (lambda r, kw=kw: rank_and_select(inputs[r][0], case.seq, **kw))
           for n, kw in chunked.items()},
        f"x_centroid_c{m}_exact": exact,
        **{f"x_centroid_c{m}_{name}": (lambda r, pick=pick: pick_pages(
            case.seq, inputs[r][0].lse, inputs[r][1], c, inputs[r][2], group=case.g, pick=pick))
           for name, pick in (("pick", "radix"), ("pick_sort", "sort"))},
    }
