"""Compare the two bias solvers (``trf``, ``bvls``) on real heads: time, objective, beta.

The bias fit is ``min_w ||A w - 1||^2`` with ``exp(beta_min) <= w <= exp(beta_max)`` (see
:mod:`.bias`). For each chosen (layer, KV head) and ratio the same problem is solved by both
``scipy.optimize.lsq_linear`` methods; the rows give each one's wall time, the relative
objective gap ``(obj_trf - obj_bvls) / obj_bvls`` and the largest |beta_trf - beta_bvls|.
kvlocks' own solver (``CompactionConfig.bias_solver``, :mod:`kvlocks.compaction.solvers`)
is tested against these two in ``tests/test_compaction_solvers.py``.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from scipy.optimize import lsq_linear

from kvlocks.compaction.bias import mass_design, partition_targets
from kvlocks.compaction.select import select_keys

DEFAULT_LAYERS = (0, 1, 3, 8, 15, 22, 29)


def compare_head(keys: torch.Tensor, queries: torch.Tensor, t: int, scale: float, *,
                 beta_min: float = -3.0, beta_max: float = 3.0) -> dict:
    """Solve one head's bias fit with both solvers (attention selection of t keys).

    Parameters
    ----------
    keys : Tensor [T, D]
    queries : Tensor [n, D]
        Reference queries.
    t : int
    scale : float

    Returns
    -------
    dict with ``t``, ``trf_s``, ``bvls_s``, ``rel_obj`` and ``max_dbeta``.
    """
    k, q = keys.float(), queries.float()
    idx = select_keys(k, q, t, scale=scale)
    z, shift = partition_targets(k, q, scale=scale)
    a = (mass_design(k[idx], q, shift, scale=scale) / z[:, None]).numpy()  # [n, t]
    b = np.ones(a.shape[0])
    row: dict = {"t": t}
    betas, objs = {}, {}
    for solver in ("trf", "bvls"):
        start = time.perf_counter()
        w = lsq_linear(a, b, bounds=(math.exp(beta_min), math.exp(beta_max)), method=solver).x
        row[f"{solver}_s"] = round(time.perf_counter() - start, 4)
        objs[solver] = float(np.sum((a @ w - 1.0) ** 2))
        betas[solver] = np.log(w)
    row["rel_obj"] = float(f"{(objs['trf'] - objs['bvls']) / max(objs['bvls'], 1e-300):.3g}")
    row["max_dbeta"] = float(f"{np.abs(betas['trf'] - betas['bvls']).max():.3g}")
    return row


def compare_capture(keys, queries, scales, ratios, *, layers=DEFAULT_LAYERS) -> list[dict]:
    """:func:`compare_head` for every KV head of ``layers`` (those that exist) at each ratio.

    ``keys``/``queries``: per layer [Hkv, T, D] / [Hkv, n, D]; ``scales``: per layer.
    """
    rows = []
    num = keys[0].shape[1]
    for layer in [x for x in layers if x < len(keys)]:
        for head in range(keys[layer].shape[0]):
            for ratio in ratios:
                t = min(num, max(1, round(ratio * num)))
                rows.append({"layer": layer, "head": head, "ratio": ratio, "T": num,
                             **compare_head(keys[layer][head], queries[layer][head], t,
                                            scales[layer])})
    return rows


def summarize_solvers(rows: list[dict]) -> list[dict]:
    """Per (T, t): fits, total seconds of each solver, speed-up, worst objective gap and beta gap."""
    out = []
    for key in sorted({(r["T"], r["t"]) for r in rows}):
        rs = [r for r in rows if (r["T"], r["t"]) == key]
        trf, bvls = sum(r["trf_s"] for r in rs), sum(r["bvls_s"] for r in rs)
        out.append({"T": key[0], "t": key[1], "fits": len(rs), "trf_s": round(trf, 2),
                    "bvls_s": round(bvls, 2), "speedup": round(bvls / trf, 2) if trf > 0 else None,
                    "max_rel_obj": max(r["rel_obj"] for r in rs),
                    "max_dbeta": max(r["max_dbeta"] for r in rs)})
    return out
