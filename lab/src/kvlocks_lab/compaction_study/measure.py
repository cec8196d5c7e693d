"""Per-head measurements of one compacted record: output errors near and far, q.u, the bound.

For one layer and KV head, :func:`head_queries` computes the full cache's outputs on the near
and far queries (:mod:`.study_queries`) once; for each ratio, given every method's compaction
(:mod:`.study_heads`), :func:`measure_head` returns one row per method (definitions in
:mod:`.study_metrics`). Far errors are also given per distance bin (``DELTA_EDGES``), so the
report can show how the fold/AM ratio changes with the distance from the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlocks.compaction.api import CompactedHead
from .metrics import bound_check, output_error, served_output
from kvlocks.compaction.values import exact_attention

# Far-query distance bins (tokens after the prefix): [1, 64], [65, 256], [257, 1024],
# [1025, 4096], > 4096 (the paper's "far" is a distance of 4k tokens or more).
DELTA_EDGES = (1, 65, 257, 1025, 4097)
QU_EDGES = tuple(round(-1.0 + 0.02 * i, 2) for i in range(101))  # q.u - 1 histogram, [-1, 1]


def delta_bins(delta: torch.Tensor) -> list[torch.Tensor]:
    """Row masks [n] of each ``DELTA_EDGES`` bin (the last bin is open-ended)."""
    edges = list(DELTA_EDGES) + [2 ** 62]
    return [(delta >= lo) & (delta < hi) for lo, hi in zip(edges[:-1], edges[1:])]


def qu_histogram(values: torch.Tensor) -> list[int]:
    """Counts of ``values`` in the ``QU_EDGES`` bins plus an underflow and an overflow count.

    Returns ``[under, bin_0, ..., bin_99, over]`` (102 counts).
    """
    x = values.double().flatten()
    edges = torch.tensor(QU_EDGES, dtype=torch.float64)
    idx = torch.bucketize(x, edges, right=True)  # 0: < -2, 81: >= 2
    counts = torch.bincount(idx, minlength=len(QU_EDGES) + 1)
    return counts.tolist()


def _r(x: float | None) -> float | None:
    """Round for the result files: 5 significant digits."""
    return None if x is None else float(f"{x:.5g}")


@dataclass(frozen=True)
class HeadQueries:
    """Near and far queries of one head with the full cache's outputs (:func:`head_queries`).

    Attributes
    ----------
    near : Tensor [n_near, D]
    far : Tensor [n_far, D]
    ref_near, ref_far : Tensor [n_near, Dv], [n_far, Dv]
        Full-cache attention outputs over the T prefix tokens.
    bins : list of Tensor [n_far], bool
        Far rows in each ``DELTA_EDGES`` bin.
    """

    near: torch.Tensor
    far: torch.Tensor
    ref_near: torch.Tensor
    ref_far: torch.Tensor
    bins: list[torch.Tensor]


def head_queries(keys: torch.Tensor, values: torch.Tensor, near: torch.Tensor, far: torch.Tensor,
                 delta: torch.Tensor, scale: float) -> HeadQueries:
    """Full-cache outputs of the near and far queries (computed once per head, for all ratios).

    Parameters
    ----------
    keys, values : Tensor [T, D], [T, Dv]
        The prefix's full K/V of this head.
    near : Tensor [n_near, D]
        Held-out context queries.
    far : Tensor [n_far, D]
        Continuation queries; ``delta`` [n_far] their distance from the prefix.
    scale : float
    """
    k, v = keys.float(), values.float()
    ref_near, _ = exact_attention(near, k, v, scale=scale)  # [n_near, Dv]
    ref_far, _ = exact_attention(far, k, v, scale=scale)  # [n_far, Dv]
    return HeadQueries(near=near, far=far, ref_near=ref_near, ref_far=ref_far, bins=delta_bins(delta))


def measure_head(heads: dict[str, CompactedHead], hq: HeadQueries, scale: float, *,
                 beta_min: float = -3.0, beta_max: float = 3.0) -> tuple[dict[str, dict], dict]:
    """Rows of one (layer, KV head) for every method, and the fold's q.u diagnostics.

    Parameters
    ----------
    heads : dict[str, CompactedHead]
        Every method's compaction of this head (``am`` and ``fold`` required).
    hq : HeadQueries
    scale : float
    beta_min, beta_max : float
        The bias box (for the bound's constant).

    Returns
    -------
    rows : dict[str, dict]
        Per method: ``err_near``, ``err_far``, ``norm_near``, ``norm_far`` (see
        :func:`~.study_metrics.output_error`) and ``err_far_bins`` (one per ``DELTA_EDGES`` bin,
        None where empty). The ``fold`` row adds ``qu_near_mean``, ``qu_far_mean`` (mean of
        q.u), ``qu_near_dev``, ``qu_far_dev`` (mean |q.u - 1|) and the bound fractions
        ``bound_{near,far}_{exact,deployed}`` (share of queries where it holds).
    qu : dict
        ``near`` and ``far``: tensors of q.u - 1 (for the pooled histogram and quantiles).
    """
    if "am" not in heads or "fold" not in heads:
        raise ValueError(f"measure_head needs 'am' and 'fold' among {sorted(heads)}")
    rows: dict[str, dict] = {}
    for name, head in heads.items():
        e_near, n_near = output_error(served_output(head, hq.near, scale), hq.ref_near)
        out_far = served_output(head, hq.far, scale)
        e_far, n_far = output_error(out_far, hq.ref_far)
        per_bin = [_r(output_error(out_far[m], hq.ref_far[m])[0]) if bool(m.any()) else None
                   for m in hq.bins]
        rows[name] = {"err_near": _r(e_near), "err_far": _r(e_far), "norm_near": _r(n_near),
                      "norm_far": _r(n_far), "err_far_bins": per_bin}
    qu = {}
    fold_row = rows["fold"]
    for where, q in (("near", hq.near), ("far", hq.far)):
        chk = bound_check(q, heads["am"], heads["fold"], scale, beta_min=beta_min,
                          beta_max=beta_max)
        dev = chk["qu"] - 1.0  # [n]
        qu[where] = dev
        fold_row[f"qu_{where}_mean"] = _r(float(chk["qu"].mean()))
        fold_row[f"qu_{where}_dev"] = _r(float(dev.abs().mean()))
        fold_row[f"bound_{where}_exact"] = _r(chk["exact_holds"] / chk["n"])
        fold_row[f"bound_{where}_deployed"] = _r(chk["deployed_holds"] / chk["n"])
    return rows, qu
