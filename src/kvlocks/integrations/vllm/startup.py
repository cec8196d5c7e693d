"""Engine-wide settings LOCKS cannot run with: refused at engine start, naming the setting.

The rule is written once here, as plain functions of plain values (unit-tested without vLLM), and
called where vLLM first shows the setting to the backend: on CUDA from
``LocksFlashAttentionBackend.validate_configuration`` (vLLM's backend choice, while the model is
built and before weights load), on the CPU from the implementation's constructor. Without the
refusal vLLM would pick another attention backend for the whole model (a dtype or block size that
FlashAttention does not take) and LOCKS would silently not run.

What is refused, with ``KVLOCKS_VLLM_CONFIG`` set:

- ``dtype`` outside :data:`CUDA_DTYPES` on CUDA (FlashAttention's dtypes) or :data:`CPU_DTYPES`;
- ``kv_cache_dtype`` other than :data:`KV_CACHE_DTYPES`: an fp8 cache (``fp8``, ``fp8_e4m3``,
  ``fp8_e5m2``, ...) would need summaries built from dequantized keys and attention over fp8
  pages, which the kernels do not do;
- ``block_size`` that is not a multiple of the LOCKS page (16 tokens; on the CPU also of 32, what
  vLLM's CPU kernels take).

A budget under two pages, an unknown field or malformed JSON are refused earlier, when the plugin
reads the variable (:mod:`kvlocks.integrations.vllm.settings`).
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.settings import ENV_VAR

CUDA_DTYPES = (torch.bfloat16, torch.float16)
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")  # "auto": the model's dtype
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention kernels


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def refusal(config: LocksConfig, *, platform: str, dtype=None, kv_cache_dtype: str | None = None,
            block_size: int | None = None) -> str | None:
    """Why LOCKS cannot run an engine with these settings (a sentence naming the setting, its value
    and the allowed values), or None. ``platform``: ``"cuda"`` or ``"cpu"``; a setting passed as
    None is not checked (vLLM has not chosen it yet)."""
    if platform not in ("cuda", "cpu"):
        raise ValueError(f"platform={platform!r}: allowed 'cuda', 'cpu'")
    allowed = CUDA_DTYPES if platform == "cuda" else CPU_DTYPES
    if dtype is not None and dtype not in allowed:
        what = "vLLM's FlashAttention, which LOCKS extends," if platform == "cuda" else "the CPU backend"
        return (f"dtype={_name(dtype)}: {what} takes dtype in {[_name(d) for d in allowed]}; "
                f"pass --dtype {_name(allowed[0])}")
    if kv_cache_dtype is not None and str(kv_cache_dtype) not in KV_CACHE_DTYPES:
        return (f"kv_cache_dtype={kv_cache_dtype!r}: LOCKS builds its page summaries from and attends over "
                f"unquantized keys and values; allowed kv_cache_dtype in {list(KV_CACHE_DTYPES)} "
                "(fp8 KV caches are not supported)")
    if block_size is not None:
        step = config.page_size if platform == "cuda" else _lcm(config.page_size, CPU_BLOCK_MULTIPLE)
        if block_size <= 0 or block_size % step:
            return (f"block_size={block_size}: must be a multiple of {step} (LOCKS pages of "
                    f"{config.page_size} tokens tile vLLM's blocks"
                    + (f"; vLLM's CPU kernels take multiples of {CPU_BLOCK_MULTIPLE})" if platform == "cpu" else ")"))
    return None


def check(config: LocksConfig, **settings) -> None:
    """Raise ``ValueError`` with :func:`refusal`'s reason, saying how to run without LOCKS."""
    why = refusal(config, **settings)
    if why is not None:
        raise ValueError(f"kvlocks: ${ENV_VAR} is set but LOCKS cannot run this engine: {why} "
                         f"(or unset {ENV_VAR} to run vLLM without LOCKS)")


def _lcm(a: int, b: int) -> int:
    import math

    return a * b // math.gcd(a, b)
