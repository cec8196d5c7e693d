"""Bytes-read accounting for decode steps, computed analytically (no host synchronisation)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    """Per-layer decode-step sums, per sequence (averaged over the batch rows implicitly:
    every row has the same length and budget in a batch).

    ``selection_bytes``: bytes a selector reads to rank pages (summaries for LOCKS, every key
    for the oracle); ``kv_bytes``: K and V bytes of the attended tokens; ``full_bytes``: K and V
    bytes dense attention would read. All per sequence, summed over KV heads.
    """

    steps: int = 0
    layer_steps: int = 0
    pages_selected: int = 0
    tokens_attended: int = 0
    context_tokens: int = 0
    selection_bytes: float = 0.0
    kv_bytes: float = 0.0
    full_bytes: float = 0.0
    per_layer: dict = field(default_factory=dict)

    def add(self, layer: int, *, pages: int, tokens: int, context: int,
            selection_bytes: float, kv_bytes: float, full_bytes: float) -> None:
        if layer == 0:
            self.steps += 1
        self.layer_steps += 1
        self.pages_selected += pages
        self.tokens_attended += tokens
        self.context_tokens += context
        self.selection_bytes += selection_bytes
        self.kv_bytes += kv_bytes
        self.full_bytes += full_bytes

    def summary(self) -> dict:
        """Averages per decode step and layer (per sequence)."""
        n = max(self.layer_steps, 1)
        read = self.selection_bytes + self.kv_bytes
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
        }
