"""Bytes-read accounting for decode steps, computed analytically (no host synchronisation)."""

from __future__ import annotations

from dataclasses import dataclass, field

LAYER_KINDS = ("sparse", "dense", "window")
_FIELDS = ("layer_steps", "tokens_attended", "selection_bytes", "kv_bytes", "full_bytes", "context_tokens")


@dataclass
class DecodeStats:
    """Per-layer decode-step sums, per sequence (averaged over the batch rows implicitly:
    every row has the same length and budget in a batch).

    ``selection_bytes``: bytes a selector reads to rank pages (summaries for LOCKS, every key
    for the oracle); ``kv_bytes``: K and V bytes of the attended tokens; ``full_bytes``: K and V
    bytes dense attention would read. All per sequence, summed over KV heads.

    Each layer step has a kind: ``"sparse"`` (a selector chose its pages), ``"dense"`` (a global
    layer read in full: method ``full``) or ``"window"`` (a sliding-window layer read its window,
    which is also its dense read: ``full_bytes == kv_bytes``). ``kinds`` holds the sums per kind.
    """

    steps: int = 0
    layer_steps: int = 0
    pages_selected: int = 0
    tokens_attended: int = 0
    context_tokens: int = 0
    selection_bytes: float = 0.0
    kv_bytes: float = 0.0
    full_bytes: float = 0.0
    kinds: dict = field(default_factory=dict)  # kind -> {field of _FIELDS: sum}

    def add(self, layer: int, *, pages: int, tokens: int, context: int, selection_bytes: float,
            kv_bytes: float, full_bytes: float, kind: str = "sparse") -> None:
        if kind not in LAYER_KINDS:
            raise ValueError(f"kind={kind!r}: allowed {LAYER_KINDS}")
        if layer == 0:
            self.steps += 1
        self.layer_steps += 1
        self.pages_selected += pages
        self.tokens_attended += tokens
        self.context_tokens += context
        self.selection_bytes += selection_bytes
        self.kv_bytes += kv_bytes
        self.full_bytes += full_bytes
        sums = self.kinds.setdefault(kind, dict.fromkeys(_FIELDS, 0))
        for name, value in zip(_FIELDS, (1, tokens, selection_bytes, kv_bytes, full_bytes, context)):
            sums[name] += value

    def summary(self) -> dict:
        """Averages per decode step and layer (per sequence), over all layers; ``layers``: how many
        layers of each kind a step had; ``by_kind``: the averages per layer of each kind."""
        n = max(self.layer_steps, 1)
        read = self.selection_bytes + self.kv_bytes
        steps = max(self.steps, 1)
        by_kind = {}
        for kind, s in self.kinds.items():
            m = s["layer_steps"]
            by_kind[kind] = {"tokens_attended": s["tokens_attended"] / m, "selection_bytes": s["selection_bytes"] / m,
                             "kv_bytes": s["kv_bytes"] / m, "bytes_read": (s["selection_bytes"] + s["kv_bytes"]) / m,
                             "full_bytes": s["full_bytes"] / m, "context_tokens": s["context_tokens"] / m}
        return {
            "decode_steps": self.steps,
            "pages_selected": self.pages_selected / n,
            "tokens_attended": self.tokens_attended / n,
            "context_tokens": self.context_tokens / n,
            "selection_bytes": self.selection_bytes / n,
            "kv_bytes": self.kv_bytes / n,
            "bytes_read": read / n,
            "full_bytes": self.full_bytes / n,
            "read_fraction": (read / self.full_bytes) if self.full_bytes else None,
            "layers": {kind: s["layer_steps"] / steps for kind, s in self.kinds.items()},
            "by_kind": by_kind,
        }


def layers_line(stats: dict) -> str:
    """``"layers per step: 3 sparse, 15 window (window 512 tokens read)"``-style text from a
    :meth:`DecodeStats.summary` (empty when it has no per-kind counts)."""
    parts = [f"{stats['layers'][k]:g} {k}" for k in LAYER_KINDS if k in stats.get("layers", {})]
    if not parts:
        return ""
    window = stats.get("by_kind", {}).get("window")
    tail = "" if window is None else f" (window layers attend {window['tokens_attended']:.0f} tokens)"
    return "layers per step: " + ", ".join(parts) + tail
