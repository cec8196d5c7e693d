"""Reference queries as compaction records them: kept rows per pass, pooled under one cap.

:class:`QueryRecorder` receives every attention call's post-RoPE queries during the capture
(:mod:`.capture`) and keeps, per pass, a seeded uniform subset of ``cap`` rows per KV head;
:func:`pool` joins the passes under the same cap, keeping user-supplied questions whole.
"""

from __future__ import annotations

import torch


def _rows(n: int, cap: int, seed: int) -> torch.Tensor | None:
    """Sorted random subset of ``cap`` of ``n`` rows (None: keep all)."""
    if n <= cap:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:cap].sort().values


class _PassRows:
    """One pass's kept query rows as its chunks arrive (``keep``: row ids to keep, None: all).

    Chunks stay on the queries' device until the pass ends (:meth:`result`: one copy to the CPU
    per layer): a copy per attention call would synchronise the device 30 times per decode step.
    """

    def __init__(self, keep: torch.Tensor | None) -> None:
        self.keep, self.chunks, self.pos = keep, {}, {}
        self._keep_on: dict = {}  # device -> keep

    def add(self, layer: int, q: torch.Tensor, group: int) -> None:
        """``q`` [Hkv, L*G, D]: the next L tokens' query rows of ``layer``, token-major."""
        first = self.pos.get(layer, 0) * group
        self.pos[layer] = self.pos.get(layer, 0) + q.shape[1] // group
        if self.keep is not None:
            lo = int(torch.searchsorted(self.keep, first))  # keep is sorted: its rows in [first, first + n)
            hi = int(torch.searchsorted(self.keep, first + q.shape[1]))
            keep = self._keep_on.setdefault(q.device, self.keep.to(q.device))
            q = q[:, keep[lo:hi] - first]
        self.chunks.setdefault(layer, []).append(q.to(torch.float32))

    def result(self) -> dict[int, torch.Tensor]:
        """Kept rows per layer, [Hkv, m, D] float32 on the CPU."""
        return {layer: torch.cat(c, dim=1).cpu() for layer, c in self.chunks.items()}


class QueryRecorder:
    """Collects pooled post-RoPE queries per layer, capped per pass (module docstring).

    Each pass is announced with its token count, so its ``cap`` rows per head are drawn
    uniformly up front and only those rows are kept as chunks arrive (memory stays at
    ``cap`` rows per layer and pass, however long the pass). Several passes can run at once
    as the rows of one batch (:meth:`start_passes`; :mod:`.capture_batch`): each keeps the rows
    it would keep alone.

    Parameters
    ----------
    num_q_heads, num_kv_heads : int
        Hq and Hkv of the model (G = Hq / Hkv query rows per token and KV head).
    cap : int
        Rows kept per KV head and pass, and in the final pool.
    seed : int
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, cap: int, seed: int) -> None:
        self.hkv, self.group, self.cap, self.seed = num_kv_heads, num_q_heads // num_kv_heads, cap, seed
        self.passes: dict[str, dict[int, torch.Tensor]] = {}
        self.counts: dict[str, int] = {}
        self.scales: dict[int, float] = {}
        self.start_pass(0)

    def start_pass(self, num_tokens: int) -> None:
        """Begin a pass of ``num_tokens`` query tokens: choose its kept rows."""
        self.start_passes([num_tokens])

    def start_passes(self, token_counts: list[int]) -> None:
        """Begin passes that run as the rows of one batch, in this order; ``valid`` (per row, the
        real tokens at the start of the next calls' L; None: all L) skips padding."""
        base = len(self.passes)
        self._rows = [_PassRows(_rows(n * self.group, self.cap, self.seed + 7919 * (base + i)))
                      for i, n in enumerate(token_counts)]
        self.valid: list[int] | None = None

    def add(self, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """Record ``query`` [B, Hq, L, D] of ``layer`` (B: the passes running): rows token-major."""
        b, hq, length, d = query.shape
        if b != len(self._rows) or hq != self.hkv * self.group:
            raise ValueError(f"query capture needs batch size {len(self._rows)} and Hq={self.hkv * self.group}, "
                             f"got queries {tuple(query.shape)}")
        for i, rows in enumerate(self._rows):
            n = length if self.valid is None else self.valid[i]
            q = query[i, :, :n].detach().reshape(self.hkv, self.group, n, d)  # [Hkv, G, n, D]
            rows.add(layer, q.transpose(1, 2).reshape(self.hkv, n * self.group, d), self.group)
        self.scales[layer] = float(scaling) if scaling is not None else d ** -0.5

    def finish_pass(self, name: str) -> None:
        """Close the current pass: its kept rows per layer, [Hkv, m <= cap, D]."""
        self.finish_passes([name])

    def finish_passes(self, names: list[str]) -> None:
        """Close the passes started together, naming them in their batch order."""
        for name, rows in zip(names, self._rows, strict=True):
            self.passes[name] = rows.result()
            self.counts[name] = max(rows.pos.values(), default=0) * self.group
        self.start_pass(0)

    def questions(self, layer: int) -> torch.Tensor | None:
        """The question passes' rows of ``layer`` as :meth:`pooled` keeps them, or None."""
        names = list(self.passes)
        return question_rows([self.passes[n][layer] for n in names], [is_question(n) for n in names], self.cap)

    def pooled(self, layer: int) -> torch.Tensor:
        """All passes of ``layer`` pooled and subsampled: [Hkv, n <= cap, D] float32."""
        names = list(self.passes)
        return pool([self.passes[n][layer] for n in names], self.cap, self.seed,
                    keep=[is_question(n) for n in names])


QUESTION_PREFIX = "question"


def is_question(name: str) -> bool:
    """Whether pass ``name`` holds user-supplied questions (kept whole by :func:`pool`)."""
    return name.startswith(QUESTION_PREFIX)


def question_rows(parts: list[torch.Tensor], keep: list[bool], cap: int) -> torch.Tensor | None:
    """The rows :func:`pool` keeps whole (the parts flagged in ``keep``), [Hkv, m <= cap, D], or None."""
    fixed = [p for p, k in zip(parts, keep, strict=True) if k]
    return torch.cat(fixed, dim=1)[:, :cap] if fixed else None


def pool(parts: list[torch.Tensor], cap: int, seed: int, keep: list[bool] | None = None) -> torch.Tensor:
    """Concatenate [Hkv, m_i, D] parts and keep ``cap`` seeded rows (the same for every head).

    Parts flagged in ``keep`` (user-supplied questions) are kept whole, ahead of the cap, and
    the others are subsampled to fill the rest: a few dozen question rows would otherwise be
    cut to a few among thousands of context rows. Without flags: the plain seeded subsample.
    """
    keep = keep or [False] * len(parts)
    rest = [p for p, k in zip(parts, keep) if not k]
    head = question_rows(parts, keep, cap)  # [Hkv, m, D]
    room = cap - (0 if head is None else head.shape[1])
    if not rest or room <= 0:
        return head
    q = torch.cat(rest, dim=1)  # [Hkv, sum m_i, D]
    rows = _rows(q.shape[1], room, seed)
    q = q if rows is None else q[:, rows]
    return q if head is None else torch.cat([head, q], dim=1)
