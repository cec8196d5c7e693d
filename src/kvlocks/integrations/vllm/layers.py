"""Which attention layers run LOCKS, and why the others do not: one decision per layer, one table.

Every LOCKS attention implementation (CUDA and CPU) decides at construction, from the layer's
attributes (:class:`LayerFacts`), with :func:`decide`. Once every layer of the model is built (the
first forward pass, vLLM's memory-profiling run, or the first metadata builder on CUDA),
:func:`report` logs ONE table for the model: each outcome with its layer numbers. Outcomes:

- ``LOCKS``: sparse decode past the budget (vLLM's attention for prefill);
- ``by design``: the layer runs vLLM's attention and that is the intended behaviour, not a
  fallback: sliding-window layers (the window is their budget: LOCKS would select inside a window
  that is already small), encoder-only attention (no decode cache);
- ``fallback``: LOCKS could in principle apply but does not (logit soft-cap, ALiBi, a head size
  the kernels lack, cross-attention, a shared KV cache, another vLLM backend, a KV cache group
  shared with such a layer). With ``"strict": true`` in ``KVLOCKS_VLLM_CONFIG`` any fallback is a
  ``ValueError`` at engine start naming the layers and reasons.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

# under vLLM's logger namespace: vLLM's default logging configuration shows it beside vLLM's own
# start-up lines (a ``kvlocks`` logger is not shown unless the user configures one)
log = logging.getLogger("vllm.kvlocks")

LOCKS, BY_DESIGN, FALLBACK = "LOCKS", "by design", "fallback"


@dataclass(frozen=True)
class LayerFacts:
    """What decides a layer: its attention type (vLLM's ``AttentionType`` value), sliding window
    (None: global), ALiBi, logit soft-cap (0 / None: none), learned sinks, head size, and the
    layer whose KV cache it shares (None: its own)."""

    attn_type: str
    sliding_window: int | None = None
    alibi: bool = False
    soft_cap: float | None = None
    sinks: bool = False
    head_size: int = 128
    kv_shared_with: str | None = None


@dataclass(frozen=True)
class Decision:
    outcome: str  # LOCKS, BY_DESIGN or FALLBACK
    reason: str  # "" for LOCKS

    def __post_init__(self) -> None:
        if self.outcome not in (LOCKS, BY_DESIGN, FALLBACK):
            raise ValueError(f"Decision.outcome={self.outcome!r}: allowed {(LOCKS, BY_DESIGN, FALLBACK)}")


def decide(facts: LayerFacts, *, head_dims, sinks_supported: bool, dense: str) -> Decision:
    """The decision for one layer. ``head_dims``: the head sizes the kernels take;
    ``sinks_supported``: the backend applies learned sinks to LOCKS rows; ``dense``: what runs
    otherwise (``"FlashAttention"``, ``"CPU attention"``), named in the reason. ``head_dims``: a
    tuple, or a ``range`` (the CPU references: even sizes)."""
    t = str(getattr(facts.attn_type, "value", facts.attn_type)).lower()  # vLLM's AttentionType is a str Enum
    if t in ("encoder", "encoder_only"):
        return Decision(BY_DESIGN, f"{dense}: {t} attention keeps no decode cache")
    if t != "decoder":
        return Decision(FALLBACK, f"{dense}: {'cross-attention' if t == 'encoder_decoder' else t + ' attention'}")
    if facts.kv_shared_with:
        return Decision(FALLBACK, f"{dense}: shares the KV cache of {facts.kv_shared_with}")
    if facts.sliding_window not in (None, -1, 0):
        return Decision(BY_DESIGN, f"{dense}: sliding window {facts.sliding_window} (the window is the budget)")
    if facts.alibi:
        return Decision(FALLBACK, f"{dense}: ALiBi")
    if facts.soft_cap:
        return Decision(FALLBACK, f"{dense}: logit soft-cap {facts.soft_cap}")
    if facts.sinks and not sinks_supported:
        return Decision(FALLBACK, f"{dense}: attention sinks")
    if facts.head_size not in head_dims:
        dims = "even sizes" if isinstance(head_dims, range) else list(head_dims)
        return Decision(FALLBACK, f"{dense}: head_size {facts.head_size} (LOCKS kernels: {dims})")
    return Decision(LOCKS, "with learned sinks" if facts.sinks else "")


def _ranges(numbers: list[int]) -> str:
    out, nums = [], sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


def _label(name: str) -> int | str:
    from kvlocks.integrations.vllm.compat import layer_number

    n = layer_number(name)
    return name if n is None else n


def table(decisions: dict[str, Decision]) -> str:
    """The table :func:`report` logs: one row per (outcome, reason), with the layers' numbers."""
    rows: dict[tuple[str, str], list] = {}
    for name, d in decisions.items():
        rows.setdefault((d.outcome, d.reason), []).append(_label(name))
    order = {LOCKS: 0, BY_DESIGN: 1, FALLBACK: 2}
    lines = [f"kvlocks: attention layers ({len(decisions)}): "
             + ", ".join(f"{sum(len(v) for (o, _), v in rows.items() if o == out)} {out}"
                         for out in (LOCKS, BY_DESIGN, FALLBACK))]
    for (outcome, reason), names in sorted(rows.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        nums = [n for n in names if isinstance(n, int)]
        where = ", ".join(filter(None, [_ranges(nums), ", ".join(n for n in names if not isinstance(n, int))]))
        lines.append(f"  {outcome:<9} {len(names):>4}  layers {where}" + (f": {reason}" if reason else ""))
    return "\n".join(lines)


def strict_error(decisions: dict[str, Decision]) -> str | None:
    """The error strict mode raises (None: no fallback)."""
    bad = {n: d for n, d in decisions.items() if d.outcome == FALLBACK}
    if not bad:
        return None
    by_reason: dict[str, list] = {}
    for name, d in bad.items():
        by_reason.setdefault(d.reason, []).append(_label(name))
    detail = "; ".join(f"layers {_ranges([n for n in v if isinstance(n, int)]) or v}: {r}"
                       for r, v in by_reason.items())
    return (f"kvlocks: \"strict\": true in $KVLOCKS_VLLM_CONFIG and {len(bad)} attention layer(s) cannot run "
            f"LOCKS: {detail}. Remove \"strict\" to let them run vLLM's attention, or serve a model whose layers "
            "LOCKS supports (sliding-window layers are accepted)")


_reported: set = set()


def reported(key) -> bool:
    """Whether the table for ``key`` was logged already (a cheap check for every forward)."""
    return key in _reported


def report(decisions: dict[str, Decision], *, strict: bool, key=None) -> bool:
    """Log the table once per ``key`` (the model's layer registry); in strict mode raise
    ``ValueError`` on any fallback. Returns whether it logged."""
    if key is not None and key in _reported:
        return False
    if key is not None:
        _reported.add(key)
    log.info("%s", table(decisions))
    err = strict_error(decisions) if strict else None
    if err:
        raise ValueError(err)
    return True


def demote(decisions: dict[str, Decision], group: list[str], dense: str) -> list[str]:
    """Layers of one KV cache group that would run LOCKS while another layer of the group cannot:
    vLLM builds one attention metadata per group, so the whole group runs ``dense``. Rewrites
    ``decisions`` in place and returns the demoted layers."""
    blockers = [n for n in group if n in decisions and decisions[n].outcome != LOCKS]
    if not blockers:
        return []
    demoted = [n for n in group if n in decisions and decisions[n].outcome == LOCKS]
    first = _label(blockers[0])
    for n in demoted:
        decisions[n] = Decision(FALLBACK, f"{dense}: its KV cache group holds layer {first}, which cannot run LOCKS")
    return demoted


def model_decisions(layers: dict, dense: str) -> dict[str, Decision]:
    """``{name: Decision}`` for the model's attention layers ``{name: vLLM attention layer}``: a
    LOCKS implementation's own decision, else a fallback naming the backend vLLM chose."""
    out = {}
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        d = getattr(impl, "kvlocks_decision", None)
        out[name] = d if d is not None else Decision(FALLBACK, f"another vLLM backend ({type(impl).__name__})")
    return out
