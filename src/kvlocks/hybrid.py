"""Hybrid models: which layers attend globally and which through a sliding window.

Gemma 3 interleaves five sliding-window layers (a token attends the last ``sliding_window``
positions, itself included) with one global (``full_attention``) layer. The layer types are read
as transformers reads them: ``layer_types`` of the text config, else every layer is
``sliding_attention`` when ``sliding_window`` is set (Mistral) and ``full_attention`` otherwise.
"""

from __future__ import annotations

LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(model_config) -> tuple[int | None, ...]:
    """Per layer: None for a global layer, the window (tokens, the current one included) for a
    sliding one. ``ValueError`` naming the layer type for anything else (chunked attention, ...)."""
    text = model_config.get_text_config(decoder=True)
    n = text.num_hidden_layers
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers (num_hidden_layers)")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(f"layer {i}: layer type {t!r} is not supported by the kvlocks cache; allowed {LAYER_TYPES}")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window={window!r}: sliding_attention layers need a window of >= 1 token")
    return tuple(window if t == "sliding_attention" else None for t in types)
