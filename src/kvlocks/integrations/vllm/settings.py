"""What ``$KVLOCKS_VLLM_CONFIG`` holds: a ``LocksConfig`` plus the plugin's own settings.

The variable is one JSON object. Its ``LocksConfig`` fields (``budget``, ``rank``, ...) make the
:class:`~kvlocks.config.LocksConfig`; the plugin's keys (:data:`PLUGIN_KEYS`) are read apart:

- ``"strict"`` (bool, default false): any layer that cannot run LOCKS (a fallback: soft-cap,
  ALiBi, an unsupported head size, cross-attention, another vLLM backend, ...) is an error at
  engine start naming the layers and the reasons, instead of a line in the layer table.
  Sliding-window layers are not fallbacks: they run vLLM's attention by design (the window is
  their budget), so strict mode accepts them.
- ``"kernels"`` (an object of :class:`~kvlocks.config.KernelOptions` fields, default none: the
  defaults): how the CUDA backend's decode plans launch their kernels, e.g.
  ``{"budget": 2048, "kernels": {"score_kernel": "packed", "pdl": false}}``.

- ``"dense_below"`` (an integer >= 0 or ``"auto"``, the default): a decode step whose rows hold at
  most this many tokens together attends every page of every row (exact attention) instead of
  scoring and selecting, which costs more than it saves on short steps; ``0`` selects on every row
  longer than the budget. ``"auto"``: on CUDA the crossover measured for the layer's head shape
  (:func:`auto_dense_below`), on CPU 0.

``LocksConfig(...).to_json()`` is a valid value (no plugin keys: not strict). Every refusal is a
``ValueError`` naming the variable, the key or field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvlocks import env
from kvlocks.config import KernelOptions, LocksConfig

ENV_VAR = "KVLOCKS_VLLM_CONFIG"


@dataclass(frozen=True, kw_only=True)
class PluginSettings:
    """The plugin's own keys of ``$KVLOCKS_VLLM_CONFIG`` (see the module doc)."""

    strict: bool = False
    kernels: KernelOptions | None = None
    dense_below: int | str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"${ENV_VAR}: \"strict\"={self.strict!r}: allowed true or false")
        d = self.dense_below
        if d != "auto" and (isinstance(d, bool) or not isinstance(d, int) or d < 0):
            raise ValueError(f"${ENV_VAR}: \"dense_below\"={d!r}: allowed \"auto\" or an integer >= 0 (tokens)")
        if isinstance(self.kernels, dict):
            try:
                object.__setattr__(self, "kernels", KernelOptions.from_json(json.dumps(self.kernels)))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"${ENV_VAR}: \"kernels\" is not valid KernelOptions: {exc}") from None
        if self.kernels is not None and not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"${ENV_VAR}: \"kernels\"={self.kernels!r}: allowed an object of KernelOptions fields")


PLUGIN_KEYS = tuple(f.name for f in dataclasses.fields(PluginSettings))


def parse(text: str) -> tuple[LocksConfig, PluginSettings]:
    """``$KVLOCKS_VLLM_CONFIG``'s text -> ``(LocksConfig, PluginSettings)``, or a ValueError naming
    what is wrong and what is allowed."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"${ENV_VAR} is not valid JSON ({exc}); expected an object such as "
                         f"'{{\"budget\": 2048}}' (LocksConfig fields, plus {list(PLUGIN_KEYS)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"${ENV_VAR} must be a JSON object of LocksConfig fields (plus {list(PLUGIN_KEYS)}), "
                         f"got a JSON {type(data).__name__}")
    plugin = {k: data.pop(k) for k in PLUGIN_KEYS if k in data}
    settings = PluginSettings(**plugin)
    try:
        config = LocksConfig.from_json(json.dumps(data))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"${ENV_VAR} does not hold a valid LocksConfig: {exc} (plugin keys: "
                         f"{list(PLUGIN_KEYS)})") from None
    return config, settings


def to_text(config: LocksConfig, settings: PluginSettings | None = None) -> str:
    """The JSON :func:`parse` reads back (plugin keys only where they differ from the defaults)."""
    data = json.loads(config.to_json())
    if settings is not None and settings.strict:
        data["strict"] = True
    if settings is not None and settings.kernels is not None:
        data["kernels"] = json.loads(settings.kernels.to_json())
    if settings is not None and settings.dense_below != "auto":
        data["dense_below"] = settings.dense_below
    return json.dumps(data, sort_keys=True)


def current() -> tuple[LocksConfig, PluginSettings] | None:
    """The parsed variable, or None when it is unset or empty."""
    text = env.get(ENV_VAR) or ""
    return parse(text) if text else None


# Decode steps of up to these many tokens (all rows together) attend densely under "auto" on CUDA,
# by K/V width per token (KV heads x head_dim): where the plan's step over every page and its
# selecting step take the same time at budget 2,048 and batch 1 (H100, scripts/gpu/dense_rows.py:
# about 12.5K tokens at GLM-4-9B's 2 x 128, 10.7K at Llama-3.1-8B's 8 x 128), bracketed in vLLM by
# 8K (dense faster) and 16K (selecting faster) for both shapes; docs/vllm.md#dense-below-the-crossover.
AUTO_DENSE_BELOW = ((256, 12288), (None, 10240))


def auto_dense_below(num_kv_heads: int, head_dim: int) -> int:
    """The ``"auto"`` crossover on CUDA for a layer of ``num_kv_heads`` KV heads of ``head_dim``."""
    width = num_kv_heads * head_dim
    return next(tokens for top, tokens in AUTO_DENSE_BELOW if top is None or width <= top)


def resolve_dense_below(setting: int | str, *, cuda: bool, num_kv_heads: int, head_dim: int) -> int:
    """Tokens up to which a decode step attends densely: ``setting`` when it is an integer, else
    :func:`auto_dense_below` on CUDA and 0 on CPU."""
    if setting != "auto":
        return int(setting)
    return auto_dense_below(num_kv_heads, head_dim) if cuda else 0
