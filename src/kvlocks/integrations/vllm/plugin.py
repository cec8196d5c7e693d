"""The ``vllm.general_plugins`` entry point: inert until configured, then registers the backend.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), maybe
several times. It is idempotent, initialises no device and imports no backend code: when
``KVLOCKS_VLLM_CONFIG`` holds a :class:`~kvlocks.config.LocksConfig` JSON (``config.to_json()``)
it points vLLM's ``CPU_ATTN`` registry entry at :mod:`kvlocks.integrations.vllm.cpu.backend` on
the CPU platform, or the ``FLASH_ATTN`` entry at :mod:`kvlocks.integrations.vllm.cuda.backend`
on CUDA; otherwise it does nothing at all.

:func:`enable` is the Python way: it writes the variable (so the engine processes vLLM spawns see
it) and registers in this process. Call it before creating ``vllm.LLM``.
"""

from __future__ import annotations

import logging
import os

from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.integrations.vllm import settings as _settings
from kvlocks.integrations.vllm.settings import ENV_VAR, PluginSettings

log = logging.getLogger(__name__)

_registered = False


def current_config() -> LocksConfig | None:
    """The LocksConfig in ``$KVLOCKS_VLLM_CONFIG``, or None when unset/empty. A malformed value
    raises a ValueError naming the variable and what is allowed (:mod:`.settings`)."""
    parsed = _settings.current()
    return None if parsed is None else parsed[0]


def current_settings() -> PluginSettings:
    """The plugin's own keys of ``$KVLOCKS_VLLM_CONFIG`` (defaults when unset)."""
    parsed = _settings.current()
    return PluginSettings() if parsed is None else parsed[1]


def register() -> None:
    """Entry point (``vllm.general_plugins``): register the LOCKS backend if configured."""
    global _registered
    config = current_config()
    if config is None or _registered:
        return
    from kvlocks.integrations.vllm import compat
    from kvlocks.integrations.vllm.cuda import compat as cuda_compat
    from kvlocks.kernels_support import check_config

    check_config(config, None, backend="torch", owner=ENV_VAR)  # the summary store's format, naming the fields
    if compat.is_cpu_platform():
        compat.register_cpu_backend()
        entry = "CPU_ATTN"
    elif cuda_compat.is_cuda_platform():
        check_config(config, None, backend="triton", owner=ENV_VAR)  # what the CUDA kernels support
        cuda_compat.register_cuda_backend()
        entry = "FLASH_ATTN"
    else:
        log.warning("kvlocks: LOCKS decode is implemented for vLLM's CPU and CUDA (FlashAttention) backends "
                    "only; on this platform vLLM's own attention runs unchanged")
        _registered = True
        return
    _registered = True
    why = " (LocksConfig's default rule for its budget; set rerank to choose)" if config.rerank_auto else ""
    log.info("kvlocks: LOCKS attention backend registered for %s (%r, %r); selection: %s%s", entry, config,
             current_settings(), config.selection(), why)


def enable(config: LocksConfig, *, strict: bool = False, dense_below: int | str = "auto",
           kernels: KernelOptions | None = None) -> None:
    """Configure LOCKS for vLLM engines started later from this process, and register it here.
    ``strict``: any layer that cannot run LOCKS is an error at engine start; ``dense_below``: decode
    steps whose rows hold at most this many tokens together attend densely; ``kernels``: how the
    CUDA backend's plans launch their kernels (None: the defaults) (:mod:`.settings`)."""
    if not isinstance(config, LocksConfig):
        raise TypeError(f"enable() takes a LocksConfig, got {type(config).__name__}")
    settings = PluginSettings(strict=strict, dense_below=dense_below, kernels=kernels)
    os.environ[ENV_VAR] = _settings.to_text(config, settings)
    register()
