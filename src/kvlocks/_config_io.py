"""Shared behaviour of kvlocks' frozen config dataclasses: copy-with-changes and strict JSON."""

from __future__ import annotations

import dataclasses
import json


class ConfigIO:
    """Mixin for frozen dataclasses: ``replace``, ``to_json`` and a strict ``from_json``."""

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str):
        """Parse :meth:`to_json` output; unknown fields are an error, not ignored."""
        name = cls.__name__
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} JSON is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{name} JSON must be an object, got {type(data).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ValueError(f"{name} JSON has unknown fields {unknown}; allowed {sorted(allowed)}")
        return cls(**data)
