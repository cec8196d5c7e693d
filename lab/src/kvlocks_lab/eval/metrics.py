"""Agreement, divergence, perplexity and paired-bootstrap metrics for comparing decode methods.

Conventions: distributions are given as log-probabilities (or logits: every function here
re-normalises with ``log_softmax`` in float32, which leaves log-probabilities unchanged) over
the last dimension ``V``; any leading dimensions (positions, records) are kept, so one call
handles a whole teacher-forced answer or a batch of them. Divergences are in nats.

``full`` always denotes the dense reference (FullKV) and ``method`` the method under test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


def _log_probs(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def kl_divergence(logp_full: torch.Tensor, logp_method: torch.Tensor) -> torch.Tensor:
    """Next-token KL(p_full || p_method) per position.

    Parameters
    ----------
    logp_full, logp_method : Tensor, shape ``[..., V]``
        Log-probabilities (or logits) of the reference and of the method, any float dtype.

    Returns
    -------
    Tensor, shape ``[...]``, float32
        ``sum_v p_full(v) * (log p_full(v) - log p_method(v))``; tokens with ``p_full = 0``
        contribute 0, and ``+inf`` results where the method gives zero probability to a token
        the reference does not. Clamped at 0 against float rounding.
    """
    if logp_full.shape != logp_method.shape:
        raise ValueError(f"shapes differ: full {tuple(logp_full.shape)} vs method {tuple(logp_method.shape)}")
    lp, lq = _log_probs(logp_full), _log_probs(logp_method)
    p = lp.exp()
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


def top1_agreement(logp_full: torch.Tensor, logp_method: torch.Tensor) -> torch.Tensor:
    """Whether the two distributions have the same arg-max token, per position.

    Parameters
    ----------
    logp_full, logp_method : Tensor, shape ``[..., V]``

    Returns
    -------
    Tensor, shape ``[...]``, float32
        1.0 where ``argmax`` agrees, else 0.0 (ties resolve to the lowest index in both).
    """
    if logp_full.shape != logp_method.shape:
        raise ValueError(f"shapes differ: full {tuple(logp_full.shape)} vs method {tuple(logp_method.shape)}")
    return (logp_full.argmax(-1) == logp_method.argmax(-1)).float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-probability of each target token.

    Parameters
    ----------
    logits : Tensor, shape ``[..., T, V]``
        Logits (or log-probabilities) predicting each position.
    targets : Tensor, shape ``[..., T]``, integer
        The tokens that actually came next.

    Returns
    -------
    Tensor, shape ``[..., T]``, float32
    """
    return _log_probs(logits).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def perplexity(logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Perplexity ``exp(-mean log p)`` over the last dimension.

    Parameters
    ----------
    logprobs : Tensor, shape ``[..., T]``
        Natural-log probabilities of the observed tokens (see :func:`token_logprobs`).
    mask : Tensor, shape ``[..., T]``, optional
        1/True for positions that count (padding excluded). Rows with no counted position
        give NaN.

    Returns
    -------
    Tensor, shape ``[...]``, float32
    """
    lp = logprobs.float()
    if mask is None:
        return torch.exp(-lp.mean(-1))
    m = mask.to(lp.dtype)
    lp = torch.where(m > 0, lp, torch.zeros_like(lp))  # padding may hold -inf
    return torch.exp(-(lp * m).sum(-1) / m.sum(-1))


def _as_list(tokens) -> list[int]:
    return tokens.tolist() if isinstance(tokens, (torch.Tensor, np.ndarray)) else list(tokens)


def exact_agreement(tokens_full: Sequence[int], tokens_method: Sequence[int]) -> float:
    """1.0 if the two greedy outputs are identical token for token (same length), else 0.0."""
    return float(_as_list(tokens_full) == _as_list(tokens_method))


def prefix_agreement(tokens_full: Sequence[int], tokens_method: Sequence[int], n: int = 16) -> float:
    """1.0 if the first ``n`` generated tokens are identical, else 0.0.

    An output that ended (EOS) before ``n`` tokens is compared as it is, so a method that stops
    early where ``full`` goes on disagrees.
    """
    if n < 1:
        raise ValueError(f"n={n}: must be >= 1")
    return float(_as_list(tokens_full)[:n] == _as_list(tokens_method)[:n])


def token_agreement(tokens_full: Sequence[int], tokens_method: Sequence[int], n: int | None = 16) -> float:
    """Fraction of the first ``n`` positions where the two outputs hold the same token.

    The denominator is the longer of the two (truncated to ``n``; ``n=None`` means all), so
    missing tokens count as disagreements; two empty outputs agree fully.
    """
    a = torch.as_tensor(_as_list(tokens_full)[:n], dtype=torch.long)
    b = torch.as_tensor(_as_list(tokens_method)[:n], dtype=torch.long)
    k, total = min(len(a), len(b)), max(len(a), len(b))
    if total == 0:
        return 1.0
    return (a[:k] == b[:k]).sum().item() / total


@dataclass(frozen=True)
class BootstrapCI:
    """Mean of paired differences ``a - b`` with a percentile bootstrap interval."""

    mean: float
    low: float
    high: float
    n: int
    n_boot: int
    confidence: float

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in ``[low, high]``."""
        return self.low <= value <= self.high


def paired_bootstrap_ci(scores_a, scores_b, *, n_boot: int = 10_000, confidence: float = 0.95,
                        seed: int = 0) -> BootstrapCI:
    """Paired bootstrap confidence interval of ``mean(scores_a - scores_b)``.

    Records are resampled with replacement, the same records for both methods (the pairing
    removes per-record difficulty from the spread). The interval is the percentile interval of
    the ``n_boot`` resampled means; it is deterministic for a given ``seed``.

    Parameters
    ----------
    scores_a, scores_b : array-like, shape ``[R]``
        Per-record scores of two methods on identical records (e.g. method and ``full``).
    n_boot : int
        Bootstrap resamples (>= 1).
    confidence : float
        Two-sided coverage in (0, 1); 0.95 gives the 2.5th and 97.5th percentiles.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    BootstrapCI
        ``mean`` is the observed mean difference; identical inputs give ``low == high == 0``.
    """
    a, b = np.asarray(scores_a, dtype=np.float64), np.asarray(scores_b, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or a.size == 0:
        raise ValueError(f"scores must be two non-empty 1-D arrays of equal length; got {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("scores must be finite")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot={n_boot!r}: must be an integer >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r}: must be in (0, 1)")
    diff = a - b  # [R]
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    rows = max(1, 4_000_000 // diff.size)  # resample in blocks of ~4M indices (32 MB)
    for start in range(0, n_boot, rows):
        m = min(rows, n_boot - start)
        idx = rng.integers(0, diff.size, size=(m, diff.size))  # [m, R]
        means[start : start + m] = diff[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return BootstrapCI(mean=float(diff.mean()), low=float(low), high=float(high), n=int(diff.size),
                       n_boot=n_boot, confidence=confidence)
