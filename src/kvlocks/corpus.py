"""Offline text for long-context tasks: a noise haystack and natural prose from the stdlib.

Nothing here touches the network. Natural text is the reference prose that CPython ships in
``pydoc_data.topics`` (about 65K words), so it is identical on every machine with the same
Python minor version. Code listings, grammar rules and headings are dropped; what remains is
split into sentences, with paragraph ends kept so the haystack still reads as paragraphs.
"""

from __future__ import annotations

import functools
import re

# Repeated filler for the "noise" haystack: short, content-free, digit-free sentences, so a
# planted needle is the only thing worth remembering.
NOISE_SENTENCES = (
    "The river runs slowly past the old mill.",
    "The hills are quiet in the evening.",
    "Small birds rest on the garden fence.",
    "The road goes on and on.",
    "Clouds drift over the fields again.",
)

_HEADING = re.compile(r"^[*=\-~^]{3,}$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text`` that are running prose (no indented code, no headings)."""
    out = []
    for para in text.split("\n\n"):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or any(ln[:1].isspace() for ln in lines):
            continue  # code listing or grammar production
        if any(_HEADING.match(ln.strip()) for ln in lines):
            continue  # section title with its underline
        flat = " ".join(" ".join(lines).split())
        if len(flat) >= 40 and flat[-1] in ".!?:)":
            out.append(flat)
    return out


@functools.lru_cache(maxsize=1)
def natural_units() -> tuple[str, ...]:
    """Sentences of stdlib reference prose, each carrying its trailing separator.

    Returns
    -------
    tuple of str
        Sentences in a fixed order (topics sorted by name). A sentence that ends a paragraph
        ends with ``"\\n\\n"``, any other with a single space, so ``"".join(units)`` is readable
        text. Only sentences of 3 to 80 words are kept.
    """
    from pydoc_data.topics import topics

    units: list[str] = []
    for name in sorted(topics):
        for para in _prose_paragraphs(topics[name]):
            sentences = [s for s in _SENTENCE_END.split(para) if 3 <= len(s.split()) <= 80]
            units.extend(s + " " for s in sentences[:-1])
            if sentences:
                units.append(sentences[-1] + "\n\n")
    return tuple(units)


def noise_units(count: int, start: int = 0) -> list[str]:
    """``count`` filler sentences cycling through :data:`NOISE_SENTENCES` from ``start``."""
    k = len(NOISE_SENTENCES)
    return [NOISE_SENTENCES[(start + i) % k] + " " for i in range(count)]


def natural_slice(count: int, start: int) -> list[str]:
    """``count`` consecutive natural sentences from offset ``start``, wrapping around."""
    units = natural_units()
    return [units[(start + i) % len(units)] for i in range(count)]


def prose_ids(tokenizer, units: list[str], tokens: int) -> tuple[list[int], str]:
    """Token ids of the first ``tokens`` tokens of ``"".join(units)`` (error if too short)."""
    text = "".join(units)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < tokens:
        raise ValueError(f"prose of {len(units)} sentences has {len(ids)} tokens < {tokens}")
    return list(ids[:tokens]), text


def units_for(tokens: int) -> int:
    """Sentences to draw for ``tokens`` tokens: stdlib prose averages ~25 tokens a sentence."""
    return tokens // 8 + 64


def calibration_text(tokenizer, *, tokens: int, avoid: list[str], seed: int) -> tuple[list[int], str]:
    """``tokens`` token ids of stdlib prose sharing no sentence with any text in ``avoid``.

    Used to calibrate selectors that must be fitted offline on other text (Loki's PCA basis).
    The sentence order starts at a seeded offset, so the same seed gives the same ids.
    """
    import random

    units = natural_units()
    start = random.Random(f"kvlocks-fidelity-calib-{seed}").randrange(len(units))
    chosen = []
    for i in range(len(units)):
        u = units[(start + i) % len(units)]
        if not any(u.strip() in text for text in avoid):
            chosen.append(u)
        if len(chosen) >= units_for(tokens):
            break
    return prose_ids(tokenizer, chosen, tokens)
