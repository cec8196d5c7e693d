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

    def __post_init__(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"${ENV_VAR}: \"strict\"={self.strict!r}: allowed true or false")
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
    return json.dumps(data, sort_keys=True)


def current() -> tuple[LocksConfig, PluginSettings] | None:
    """The parsed variable, or None when it is unset or empty."""
    text = env.get(ENV_VAR) or ""
    return parse(text) if text else None
