"""What ``kvlocks compact`` tells a user before it starts: an estimated time and the trade-off.

``estimate_seconds`` is a cost model with constants measured on the bundled model with one
thread of a shared 2-core x86-64 CPU (``docs/results/2026-12-03-cpu-compaction-profile/``,
T = 4,096, t = 410, n = 4,096: context pass 45.7 s, repeat spans 22.8 s, self-study 18.1 s,
fits 54.0 s, other jobs running). Other models scale with their layer count and head
shapes only roughly, other machines by their speed: the estimate is a scale, not a promise.
"""

from __future__ import annotations

# seconds per token of a pass over the prefix (a + b * T / 4096), per decode step, per layer
_PREFILL = (8.0e-3, 3.0e-3)
_REPEAT = (8.0e-3, 6.0e-3)
_STEP = (0.06, 0.07)
_FULL = 17.0 / 30  # one layer's full-cache pass at n = T = 4096
_FITS = 37.0 / 30  # one layer's bias fit, fold and value refits at n = 4096, t = 410


def estimate_seconds(num_tokens: int, kept: int, *, max_queries: int = 4096, repeat_tokens: int = 1536,
                     repeat_span: int = 256, decode_steps: int = 141, num_layers: int = 30) -> float:
    """Rough wall time of compacting ``num_tokens`` to ``kept`` entries (module docstring).

    Parameters
    ----------
    num_tokens, kept : int
        T and t.
    max_queries : int
        Reference queries per KV head (n).
    repeat_tokens, repeat_span : int
        As in :class:`~.passes.ReferenceConfig`.
    decode_steps : int
        Single-token forwards of the self-study passes (prompts plus answers).
    num_layers : int

    Returns
    -------
    float, seconds
    """
    x = num_tokens / 4096
    repeat = num_tokens if num_tokens <= repeat_tokens else -(-repeat_tokens // repeat_span) * repeat_span
    capture = (num_tokens * (_PREFILL[0] + _PREFILL[1] * x) + repeat * (_REPEAT[0] + _REPEAT[1] * x)
               + decode_steps * (_STEP[0] + _STEP[1] * x))
    n = min(max_queries, 3 * (num_tokens + repeat) + decode_steps * 3) / 4096
    fits = num_layers * (_FULL * n * x + _FITS * n * (kept / 410) ** 2 + 0.05)
    return capture + fits


# Answer retention of `fold` with the default reference queries and the default coverage guard
# and value anchor, on the bundled model's 2K retrieval records that full attention answers
# (passkey, niah_single_noise, niah_single_text, niah_multikey; 77 records; docs/compaction.md,
# "Answer retention"): ratio -> (answers kept, records). AM's plain selection kept 26 / 20 / 15 / 13.
RETENTION: dict[float, tuple[int, int]] = {0.5: (39, 77), 0.25: (30, 77), 0.1: (18, 77), 0.05: (14, 77)}
QUESTION_RETENTION = (76, 77)  # the same records at 0.25 with each record's question given (--question)
DEFAULT_RATIO = 0.25
RATIO_HELP = ("At 0.25 the default keeps a pass key in filler text (18 of 20) and half the needles in noise "
              "but loses almost every fact planted in prose on the bundled model: pass the questions you will "
              "ask (--question); docs/compaction.md, 'Answer retention'.")


def tradeoff_lines(ratio: float, with_questions: bool) -> list[str]:
    """What the measured retention says about ``ratio`` (the nearest measured ratio)."""
    near = min(RETENTION, key=lambda r: abs(r - ratio))
    kept, n = RETENTION[near]
    lines = [f"measured quality near ratio {near:g} (bundled model, 2K-token retrieval records that full "
             f"attention answers): {kept} of {n} answers kept with the default reference queries"]
    if with_questions:
        lines.append(f"  with the question given (--question), at ratio 0.25: {QUESTION_RETENTION[0]} of "
                     f"{QUESTION_RETENTION[1]} answers kept (the README's example answered too)")
    else:
        lines.append("  facts planted in prose (numbers, keys) are mostly lost: pass the questions you will "
                     "ask with --question (at ratio 0.25 it kept the answer on the measured documents)")
    return lines
