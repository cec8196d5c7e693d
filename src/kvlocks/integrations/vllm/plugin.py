"""The ``vllm.general_plugins`` entry point: inert until configured, then registers the backend.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), maybe
several times. It is idempotent, initialises no device and imports no backend code: when
``KVLOCKS_VLLM_CONFIG`` holds a :class:`~kvlocks.config.LocksConfig` JSON (``config.to_json()``)
it points vLLM's ``CPU_ATTN`` registry entry at :mod:`kvlocks.integrations.vllm.backend`;
otherwise it does nothing at all.

:func:`enable` is the Python way: it writes the variable (so the engine processes vLLM spawns see
it) and registers in this process. Call it before creating ``vllm.LLM``.
"""

from __future__ import annotations

import logging
import os

from kvlocks.config import LocksConfig

log = logging.getLogger(__name__)

ENV_VAR = "KVLOCKS_VLLM_CONFIG"
_registered = False


def current_config() -> LocksConfig | None:
    """The LocksConfig in ``$KVLOCKS_VLLM_CONFIG``, or None when unset/empty. Bad JSON raises."""
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        return LocksConfig.from_json(text)
    except ValueError as exc:
        raise ValueError(f"${ENV_VAR} does not hold a valid LocksConfig JSON: {exc}") from None


def register() -> None:
    """Entry point (``vllm.general_plugins``): register the LOCKS backend if configured."""
    global _registered
    config = current_config()
    if config is None or _registered:
        return
    from kvlocks.cache.layout import check_kernel_config
    from kvlocks.integrations.vllm import compat

    if (config.basis_bits, config.coef_bits) != (4, 8):
        check_kernel_config(config, 2)  # raises the paged store's error naming the fields
    compat.register_cpu_backend()
    _registered = True
    if not compat.is_cpu_platform():
        log.warning("kvlocks: LOCKS decode is implemented for vLLM's CPU backend only; "
                    "on this platform vLLM's own attention runs unchanged")
    log.info("kvlocks: LOCKS attention backend registered for CPU_ATTN (%r)", config)


def enable(config: LocksConfig) -> None:
    """Configure LOCKS for vLLM engines started later from this process, and register it here."""
    if not isinstance(config, LocksConfig):
        raise TypeError(f"enable() takes a LocksConfig, got {type(config).__name__}")
    os.environ[ENV_VAR] = config.to_json()
    register()
