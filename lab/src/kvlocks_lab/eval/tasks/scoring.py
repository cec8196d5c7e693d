"""Scoring a prediction against a record's references (RULER's rules plus a strict variant).

All comparisons ignore case. ``prediction`` is the generated text only (the answer prefix is
part of the prompt, not of the prediction).

- ``string_match_all``: fraction of the references that occur in the prediction.
- ``string_match_part``: 1 if any reference occurs in the prediction, else 0.
- ``string_match_strict``: the prediction's first answer-shaped spans (a number, a word, a UUID,
  ... as the task declares) must *be* the references, not merely contain them: with m
  references, the fraction of references found among the first m spans. With one reference
  this is 1 exactly when the first span equals it, so "12" does not pass for "112" and a
  rambling answer that mentions the value late does not pass either.
"""

from __future__ import annotations

import re
from typing import Sequence

SHAPES: dict[str, str] = {
    "number": r"\d+",
    "word": r"[A-Za-z]+(?:['-][A-Za-z]+)*",
    "token": r"[A-Za-z0-9]+",  # a word or a number: short free-form answers
    "varname": r"\b[A-Z]{5}\b",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
_COMPILED = {name: re.compile(pattern) for name, pattern in SHAPES.items()}
METRICS = ("all", "part")


def _check_refs(references: Sequence[str]) -> None:
    if isinstance(references, str) or not references:
        raise ValueError(f"references={references!r}: must be a non-empty sequence of strings")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` that occur (case-insensitively) in ``prediction``."""
    _check_refs(references)
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` occurs (case-insensitively) in ``prediction``, else 0.0."""
    _check_refs(references)
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in references))


def answer_spans(prediction: str, shape: str) -> list[str]:
    """All answer-shaped spans of ``prediction`` in order (``shape`` a key of :data:`SHAPES`)."""
    if shape not in _COMPILED:
        raise ValueError(f"shape={shape!r}: allowed {tuple(SHAPES)}")
    return _COMPILED[shape].findall(prediction)


def string_match_strict(prediction: str, references: Sequence[str], shape: str) -> float:
    """Fraction of ``references`` equal (case-insensitively) to one of the first m spans.

    m = ``len(references)``; spans are found with :data:`SHAPES` ``[shape]``.
    """
    _check_refs(references)
    first = {s.lower() for s in answer_spans(prediction, shape)[: len(references)]}
    return sum(ref.lower() in first for ref in references) / len(references)


def score(record, prediction: str) -> dict[str, float]:
    """Every score of ``prediction`` for ``record`` (a :class:`TaskRecord` or its dict).

    Returns
    -------
    dict
        ``score`` (the task's declared metric), ``match_all``, ``match_part`` and ``strict``.
    """
    get = record.get if isinstance(record, dict) else lambda k: getattr(record, k)
    refs, metric = get("references"), get("metric")
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}: allowed {METRICS}")
    out = {
        "match_all": string_match_all(prediction, refs),
        "match_part": string_match_part(prediction, refs),
        "strict": string_match_strict(prediction, refs, get("shape")),
    }
    out["score"] = out["match_all"] if metric == "all" else out["match_part"]
    return out
