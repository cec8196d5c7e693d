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
        return cls(**cls._from_json_values(data))

    @classmethod
    def _from_json_values(cls, data: dict) -> dict:
        """Field values as parsed from JSON, before construction (a subclass may convert them)."""
        return data


def check_int(owner: str, name: str, value, low: int, high: int | None = None) -> None:
    """Raise ``ValueError`` naming ``owner.name`` unless ``value`` is an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name}={value!r}: must be an integer")
    if value < low or (high is not None and value > high):
        upper = "" if high is None else f" and <= {high}"
        raise ValueError(f"{owner}.{name}={value}: must be >= {low}{upper}")
