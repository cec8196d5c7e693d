"""The kernel bench's rows for ``locks_centroid`` (``LocksConfig.rerank_scores = "centroid"``): the
centroid score kernel alone (:mod:`kvlocks.scoring.triton_centroid`) and the whole step of
:class:`kvlocks.plan.DecodePlan` at each candidate multiple, with the bytes each must read."""

from __future__ import annotations

import dataclasses

import torch

CENTROID_MULTIPLES = (16, 8)  # the locks_centroid candidate multiples measured at every context


def centroid_bytes(case, rows, select, attend) -> dict:
    """locks_centroid: the int8 centroids and their
    float16 scales, the fused selection's per-head scores, the candidates' keys, the attention."""
    cen = rows * case.p * (case.d + 2)
    out = {"centroid_score": cen}
    for m in CENTROID_MULTIPLES:
        c = dataclasses.replace(case.lcfg, rerank=m)
        cand = min(case.p, c.rerank_candidates(case.p) + c.sink_pages + c.recent_pages)
        out[f"centroid_c{m}_total"] = cen + select + rows * cand * case.lcfg.page_size * case.d * 2 + attend
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
