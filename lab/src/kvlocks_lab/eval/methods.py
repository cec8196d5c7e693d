"""How ``kvlocks eval`` spells its methods, and what each spelling means.

Three kinds of method share one ``--methods`` list:

- ``full``: dense attention over the whole cache (FullKV), the reference of every comparison;
- a selector (``locks``, ``oracle``, ``quest``, ...): sparse decode, run once per budget of
  ``--budgets`` (tokens attended per layer and KV head at a decode step);
- a compaction, spelled ``NAME@RATIO`` (e.g. ``fold@0.1``): the record's context is compacted
  once to ``t = max(1, round(RATIO * T))`` entries per layer and KV head (T = context tokens),
  and the rest of the record is decoded densely over that compacted cache. ``RATIO`` is the
  kept fraction, ``0 < RATIO <= 1``; ``--budgets`` do not apply. NAME is one of the
  compaction package's methods (``am``, ``fold``, ``drop``, ``rank1``, ``drop_refit``,
  ``merge_fold``).
- a compaction followed by sparse decode, spelled ``NAME@RATIO+SELECTOR`` (e.g.
  ``fold@0.1+locks``): the compacted cache is an ordinary cache, so the selector's summaries are
  built over its t entries and every budget of ``--budgets`` runs, as for a selector. NAME must
  be a plain-cache compaction (``fold``, ``drop``, ``drop_refit``, ``merge_fold``): ``am`` and
  ``rank1`` keep a logit bias that sparse decode cannot apply.

Spellings are canonicalised (``fold@0.10`` becomes ``fold@0.1``) so result rows of one run
always carry the same method string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def selector_names() -> tuple[str, ...]:
    """``full`` and every registered selector."""
    from kvlocks.integrations.hf import method_names

    return method_names()


def compaction_names() -> tuple[str, ...]:
    from kvlocks.compaction.config import METHODS

    return METHODS


PLAIN_CACHE = ("fold", "drop", "drop_refit", "merge_fold")  # compactions that need no logit bias


@dataclass(frozen=True)
class MethodSpec:
    """One parsed method.

    Attributes
    ----------
    name : str
        Canonical spelling, the ``method`` field of result rows (``"fold@0.1"``).
    kind : str
        ``"full"``, ``"selector"`` or ``"compaction"``.
    base : str
        Selector or compaction method name without the ratio (``"fold"``).
    ratio : float or None
        Kept fraction of the context for a compaction, else None.
    selector : str or None
        For ``NAME@RATIO+SELECTOR``: the selector that decodes over the compacted cache.
    """

    name: str
    kind: str
    base: str
    ratio: float | None = None
    selector: str | None = None

    @property
    def budgeted(self) -> bool:
        """Whether the method runs once per budget (selectors, and compactions with a selector)."""
        return self.kind == "selector" or self.selector is not None


def allowed_text() -> str:
    return (f"{selector_names()} or NAME@RATIO with NAME in {compaction_names()} and "
            "0 < RATIO <= 1 (e.g. 'fold@0.1'), or NAME@RATIO+SELECTOR with NAME in "
            f"{PLAIN_CACHE} (e.g. 'fold@0.1+locks')")


def parse_method(text: str) -> MethodSpec:
    """Parse one ``--methods`` entry; raises ``ValueError`` saying what is allowed."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"method {text!r}: must be a non-empty string; allowed {allowed_text()}")
    text = text.strip()
    if "+" in text:
        comp, _, selector = text.partition("+")
        spec = parse_method(comp)
        if spec.kind != "compaction":
            raise ValueError(f"method {text!r}: {comp!r} is not NAME@RATIO; allowed {allowed_text()}")
        if spec.base not in PLAIN_CACHE:
            raise ValueError(f"method {text!r}: {spec.base!r} keeps a logit bias that sparse decode cannot "
                             f"apply; combine a selector with one of {PLAIN_CACHE}")
        if selector not in selector_names() or selector == "full":
            raise ValueError(f"method {text!r}: {selector!r} is not a selector; allowed "
                             f"{tuple(n for n in selector_names() if n != 'full')}")
        return MethodSpec(name=f"{spec.name}+{selector}", kind="compaction", base=spec.base, ratio=spec.ratio,
                          selector=selector)
    if "@" not in text:
        if text in selector_names():
            return MethodSpec(name=text, kind="full" if text == "full" else "selector", base=text)
        if text in compaction_names():
            raise ValueError(f"method {text!r} is a compaction: give the kept fraction of the context, "
                             f"e.g. '{text}@0.1' (0 < ratio <= 1)")
        raise ValueError(f"unknown method {text!r}; allowed {allowed_text()}")
    base, _, ratio_text = text.partition("@")
    if base not in compaction_names():
        raise ValueError(f"method {text!r}: {base!r} is not a compaction method; NAME@RATIO needs "
                         f"NAME in {compaction_names()}")
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"method {text!r}: ratio {ratio_text!r} is not a number; "
                         "spell it like 'fold@0.1' (kept fraction, 0 < ratio <= 1)") from None
    if not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"method {text!r}: ratio {ratio} must be in (0, 1] (the kept fraction of the context)")
    return MethodSpec(name=f"{base}@{ratio:g}", kind="compaction", base=base, ratio=ratio)


def parse_methods(methods) -> tuple[MethodSpec, ...]:
    """Parse a list of methods; duplicates (after canonicalisation) are an error."""
    specs = tuple(parse_method(m) for m in methods)
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"methods {dup} are given more than once")
    return specs
