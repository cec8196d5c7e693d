"""The environment variables kvlocks reads: one table (:data:`VARIABLES`), one way to read them.

:func:`table` renders it as Markdown (name, meaning, allowed values, default). Values are
read when asked for (:func:`get`, :func:`flag`, :func:`number`), not at import; a value outside the
allowed ones raises ``ValueError`` naming the variable, the value and what is allowed. Variables of
the test suite and the scripts (``KVLOCKS_HEAVY_FIRST``, ``KVLOCKS_REQUIRE_DEVICE_TRITON``, ...) are
not read by the library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One row of the table. ``default``: the value when unset or empty (None: unset means what
    ``meaning`` says); ``choices``: the only values accepted; ``positive_number``: a number > 0."""

    name: str
    meaning: str
    allowed: str
    default: str | None
    choices: tuple[str, ...] | None = None
    positive_number: bool = False


FLAG = ("0", "1")
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("KVLOCKS_PDL", "programmatic dependent launch of the decode kernels on Hopper and later GPUs "
             "(the default of KernelOptions.pdl)", "'1' (on) or '0' (off)", "1", FLAG),
    Variable("KVLOCKS_NVCC", "the nvcc that compiles the CUDA score kernel (unset: nvcc on PATH, else "
             "$CUDA_HOME/bin/nvcc)", "a path to an nvcc executable", None),
    Variable("KVLOCKS_CACHE", "cache directory of compiled CUDA libraries (in cuda/)", "a directory",
             "~/.cache/kvlocks"),
    Variable("KVLOCKS_MODEL_DIR", "where converted bundled models live", "a directory", "~/.cache/kvlocks/models"),
    Variable("KVLOCKS_VLLM_CONFIG", "the LocksConfig of the vLLM plugin (unset: the plugin is inert)",
             "a JSON object of LocksConfig fields, plus \"strict\": true|false (any layer that cannot "
             "run LOCKS is then an error at engine start)", None),
    Variable("KVLOCKS_VLLM_PLAN_GIB", "GiB of decode-plan buffers the vLLM CUDA backend keeps (one plan per "
             "power-of-two batch up to the cap this sets)", "a number > 0", "2", positive_number=True),
    Variable("KVLOCKS_VLLM_TRACE", "(debug) the vLLM backend appends one JSON line per (layer, decode request) "
             "to this file (unset: no trace)", "a file path", None),
    Variable("KVLOCKS_VLLM_VERIFY", "(debug) the vLLM backend checks every summary it uses against the keys "
             "now in its page", "'1' or '0'", "0", FLAG),
    Variable("KVLOCKS_VLLM_CHECK", "(debug) the vLLM CUDA backend checks its summaries' tags and the summaries "
             "it uses at every step", "'1' or '0'", "0", FLAG),
    Variable("KVLOCKS_VLLM_IGNORE_TAGS", "(debug) the vLLM backend ignores its summaries' validity tags "
             "(a negative control for tests)", "'1' or '0'", "0", FLAG),
    Variable("KVLOCKS_VLLM_COUNTERS", "(debug) the vLLM CUDA backend writes its debug counters (tag mismatches, "
             "stale summaries used with KVLOCKS_VLLM_VERIFY, LOCKS rows, ...) as JSON to this file when its process "
             "exits", "a file path", None),
    Variable("KVLOCKS_VLLM_CONNECTOR_TRACE", "(debug) the KV connector appends one JSON line per load and "
             "rejection to this file (unset: no trace)", "a file path", None),
    Variable("KVLOCKS_COMMIT", "(lab) the commit the benchmarks and studies record in their results "
             "(unset: git's HEAD where they read it, else null)",
             "any text", None),
)}


def get(name: str) -> str | None:
    """The value of ``name`` (surrounding spaces removed), its default when unset or empty."""
    var = VARIABLES.get(name)
    if var is None:
        raise ValueError(f"{name!r} is not a kvlocks environment variable; known: {sorted(VARIABLES)}")
    value = os.environ.get(name, "").strip()
    if not value:
        return var.default
    ok = var.choices is None or value in var.choices
    if ok and var.positive_number:
        try:
            ok = float(value) > 0
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{name}={os.environ[name]!r}: allowed {var.allowed}")
    return value


def flag(name: str) -> bool:
    """A ``'0'``/``'1'`` variable as a bool."""
    if name in VARIABLES and VARIABLES[name].choices != FLAG:
        raise ValueError(f"{name} is not a 0/1 flag")
    return get(name) == "1"


def number(name: str) -> float:
    """A numeric variable (``> 0``) as a float."""
    if name in VARIABLES and not VARIABLES[name].positive_number:
        raise ValueError(f"{name} is not a numeric variable")
    return float(get(name))


def table() -> str:
    """The table as Markdown."""
    rows = ["| name | meaning | allowed values | default |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.meaning} | {v.allowed} | {'-' if v.default is None else '`' + v.default + '`'} |"
             for v in VARIABLES.values()]
    return "\n".join(rows)
