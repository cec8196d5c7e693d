"""What ``kvlocks compact`` tells a user before it starts: an estimated time and the trade-off.

``estimate_seconds`` is a cost model with constants measured on the bundled model with one
thread of a shared 2-core x86-64 CPU (``docs/results/2026-12-03-cpu-compaction-profile/``,
T = 4,096, t = 410, n = 4,096: context pass 45.7 s, repeat spans 22.8 s, self-study 18.1 s,
fits 54.0 s, other jobs running). The fits scale with the (layer, KV head) pairs fitted (90 there;
3 on Gemma 3 270M, whose 15 sliding-window layers are kept, not fitted), the passes with layers x
hidden size (30 x 576 there). Gemma 3 270M, 3,753 tokens at 0.25 with a question, one thread
beside another job: estimated 63 s, took 39.9 s (2026-12-05). Other models and machines differ:
the estimate is a scale, not a promise.
"""

from __future__ import annotations

# seconds per token of a pass over the prefix (a + b * T / 4096), per decode step, per layer
_PREFILL = (8.0e-3, 3.0e-3)
_REPEAT = (8.0e-3, 6.0e-3)
_STEP = (0.06, 0.07)
_FULL = 17.0 / 30  # one layer's full-cache pass at n = T = 4096
_FITS = 37.0 / 30  # one layer's bias fit, fold and value refits at n = 4096, t = 410


def estimate_seconds(num_tokens: int, kept: int, *, max_queries: int = 4096, repeat_tokens: int = 1536,
                     repeat_span: int = 256, decode_steps: int = 141, layer_heads: int = 90,
                     pass_scale: float = 1.0) -> float:
    """Rough wall time of compacting ``num_tokens`` to ``kept`` entries (module docstring).

    Parameters
    ----------
    num_tokens, kept : int
        T and t.
    max_queries : int
        Reference queries per KV head (n).
    repeat_tokens, repeat_span : int
        As in :class:`~kvlocks.integrations.hf.compaction.passes.ReferenceConfig`.
    decode_steps : int
        Single-token forwards of the self-study passes (prompts plus answers).
    layer_heads : int
        (layer, KV head) pairs fitted: compacted layers x KV heads (the bundled model's 30 x 3).
    pass_scale : float
        The model's layers x hidden size over the bundled model's (30 x 576).

    Returns
    -------
    float, seconds
    """
    x = num_tokens / 4096
    repeat = num_tokens if num_tokens <= repeat_tokens else -(-repeat_tokens // repeat_span) * repeat_span
    capture = pass_scale * (num_tokens * (_PREFILL[0] + _PREFILL[1] * x) + repeat * (_REPEAT[0] + _REPEAT[1] * x)
                            + decode_steps * (_STEP[0] + _STEP[1] * x))
    n = min(max_queries, 3 * (num_tokens + repeat) + decode_steps * 3) / 4096
    fits = layer_heads / 3 * (_FULL * n * x + _FITS * n * (kept / 410) ** 2 + 0.05)
    return capture + fits


# Answer retention of `fold` with the default reference queries and the default coverage guard and
# value anchor, per bundled model, on its retrieval records that full attention answers (passkey,
# niah_single_noise, niah_single_text, niah_multikey; docs/compaction.md, "Answer retention"):
# ratio -> (answers kept, records), and with each record's question given (--question).
# SmolLM2: 2K records, 77 that full answers (AM's plain selection kept 26 / 20 / 15 / 13).
# Gemma 3 270M: 2K records, 75 that full answers (its global layers compacted).
RETENTION: dict[str, dict[float, tuple[int, int]]] = {
    "smollm2-135m": {0.5: (39, 77), 0.25: (30, 77), 0.1: (18, 77), 0.05: (14, 77)},
    "gemma3-270m": {0.5: (33, 75), 0.25: (13, 75), 0.1: (8, 75), 0.05: (5, 75)},
}
QUESTION_RETENTION = {"smollm2-135m": {0.25: (76, 77)},
                      "gemma3-270m": {0.5: (75, 75), 0.25: (75, 75), 0.1: (69, 75), 0.05: (64, 75)}}
DEFAULT_RATIO = 0.25
RATIO_HELP = ("At 0.25 the default keeps a pass key in filler text (18 of 20) and half the needles in noise "
              "but loses almost every fact planted in prose on the bundled model: pass the questions you will "
              "ask (--question); docs/compaction.md, 'Answer retention'.")


def tradeoff_lines(ratio: float, with_questions: bool, model: str = "smollm2-135m") -> list[str]:
    """What the measured retention says about ``ratio`` (the nearest measured ratio) for ``model``
    (a bundled model's name; any other model is told the bundled model's numbers, as such)."""
    measured = model if model in RETENTION else "smollm2-135m"
    near = min(RETENTION[measured], key=lambda r: abs(r - ratio))
    kept, n = RETENTION[measured][near]
    where = measured if measured == model else f"{measured}, not this model"
    lines = [f"measured quality near ratio {near:g} ({where}, 2K-token retrieval records that full "
             f"attention answers): {kept} of {n} answers kept with the default reference queries"]
    if with_questions:
        q = QUESTION_RETENTION[measured]
        qr = min(q, key=lambda r: abs(r - ratio))
        lines.append(f"  with the question given (--question), at ratio {qr:g}: {q[qr][0]} of {q[qr][1]} answers kept")
    else:
        lines.append("  facts planted in prose (numbers, keys) are mostly lost: pass the questions you will "
                     "ask with --question (at ratio 0.25 it kept the answer on the measured documents)")
    return lines
