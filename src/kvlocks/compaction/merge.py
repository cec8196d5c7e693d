"""Log-count merging: near-duplicate keys become one mean key with logit bias log(count).

For c exact copies of a key, one copy with bias ``log c`` gives every query the same
attention (``c exp(l) = exp(l + log c)``), so merging is exact for duplicates and close for
near-duplicates. The bias is query-independent, so :mod:`.fold` can move it into the keys
(``"merge_fold"``); its range is [0, log(max count)].

Clustering is greedy and deterministic (leader clustering): walk positions in ascending
order; an unassigned position becomes a leader and takes every later unassigned position
whose cosine similarity to the leader's key is >= threshold. Clusters are ordered by leader
position, and the leader's position is the cluster's representative index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .select import attention_scores, top_t


@dataclass(frozen=True)
class MergeResult:
    """Merged entries of one head.

    Attributes
    ----------
    keys : Tensor [M, D], float32
        Mean key of each cluster.
    values : Tensor [M, Dv], float32
        Mean value of each cluster.
    counts : Tensor [M], int64
        Cluster sizes; the logit bias is ``log(counts)``.
    indices : Tensor [M], int64
        Leader (lowest) position of each cluster, ascending.
    """

    keys: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor
    indices: torch.Tensor

    @property
    def bias(self) -> torch.Tensor:
        """``log(counts)`` as float32 [M]."""
        return torch.log(self.counts.to(torch.float32))


def _cosine(keys: torch.Tensor) -> np.ndarray:
    """Pairwise cosine similarity [T, T] (float64); a zero key has similarity 0 to all."""
    k = keys.to(torch.float64)
    k = k / k.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (k @ k.T).numpy()


def cluster_labels(keys: torch.Tensor, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Leader clustering (module docstring).

    Parameters
    ----------
    keys : Tensor [T, D]
    threshold : float
        Cosine similarity in [-1, 1].

    Returns
    -------
    leader : ndarray [T], int64
        Leader position of each position's cluster.
    sim : ndarray [T], float64
        Cosine similarity of each position to its leader (1 for leaders).
    """
    cos = _cosine(keys)  # [T, T]
    num = cos.shape[0]
    leader = np.full(num, -1, dtype=np.int64)
    for i in range(num):
        if leader[i] >= 0:
            continue
        take = (leader < 0) & (cos[i] >= threshold)
        take[:i] = False
        take[i] = True
        leader[take] = i
    sim = cos[np.arange(num), leader]
    sim[leader == np.arange(num)] = 1.0
    return leader, sim


def _build(keys: torch.Tensor, values: torch.Tensor, leader: np.ndarray) -> MergeResult:
    reps, inverse, counts = np.unique(leader, return_inverse=True, return_counts=True)
    inv = torch.from_numpy(inverse).to(torch.int64)  # [T] cluster id
    cnt = torch.from_numpy(counts).to(torch.int64)  # [M]
    m = reps.shape[0]
    f64 = torch.float64
    ksum = torch.zeros(m, keys.shape[1], dtype=f64).index_add_(0, inv, keys.to(f64))  # [M, D]
    vsum = torch.zeros(m, values.shape[1], dtype=f64).index_add_(0, inv, values.to(f64))  # [M, Dv]
    c = cnt.to(torch.float64)[:, None]
    return MergeResult(keys=(ksum / c).to(torch.float32), values=(vsum / c).to(torch.float32),
                       counts=cnt, indices=torch.from_numpy(reps).to(torch.int64))


def merge_duplicates(keys: torch.Tensor, values: torch.Tensor, *, threshold: float) -> MergeResult:
    """Merge every cluster of near-duplicate keys (no budget).

    Parameters
    ----------
    keys : Tensor [T, D]
    values : Tensor [T, Dv]
    threshold : float
        Cosine similarity in [-1, 1] at or above which a key joins a leader.

    Returns
    -------
    MergeResult with M <= T entries.
    """
    leader, _ = cluster_labels(keys, threshold)
    return _build(keys, values, leader)


def merge_to_budget(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, t: int, *,
                    threshold: float, scale: float | None = None) -> MergeResult:
    """Merge near-duplicates, then meet the budget exactly: t entries.

    If the clustering leaves M < t clusters, the t - M least similar members (lowest cosine to
    their leader; ties to the lower position) are split back out as singletons, so the merges
    that are kept are the closest ones. If M > t, the t clusters with the largest RMS
    attention weight under the merged, log-count-biased cache are kept and the rest dropped.

    Parameters
    ----------
    keys : Tensor [T, D]
    values : Tensor [T, Dv]
    q : Tensor [n, D]
        Reference queries (used only when M > t).
    t : int
        1 <= t <= T.
    threshold : float
    scale : float, optional

    Returns
    -------
    MergeResult with exactly t entries.
    """
    num = keys.shape[0]
    if not 1 <= t <= num:
        raise ValueError(f"t={t}: must satisfy 1 <= t <= T={num}")
    leader, sim = cluster_labels(keys, threshold)
    pos = np.arange(num)
    short = t - int((leader == pos).sum())
    if short > 0:
        members = pos[leader != pos]
        order = np.lexsort((members, sim[members]))  # similarity asc, then position asc
        split = members[order[:short]]
        leader[split] = split
    merged = _build(keys, values, leader)
    if merged.counts.shape[0] <= t:
        return merged
    keep = top_t(attention_scores(merged.keys, q, scale=scale, bias=merged.bias), t)  # [t]
    return MergeResult(keys=merged.keys[keep], values=merged.values[keep],
                       counts=merged.counts[keep], indices=merged.indices[keep])
