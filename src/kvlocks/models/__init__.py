"""Load the bundled model or any local Hugging Face GQA decoder, offline."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvlocks.models.bundled import BUNDLED, converted_dir

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def resolve(name_or_path: str) -> Path:
    """A bundled model name (converted on first use) or a local Hugging Face directory."""
    if name_or_path in BUNDLED:
        return converted_dir(name_or_path)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name_or_path!r} is neither a bundled model {sorted(BUNDLED)} nor a local "
            "Hugging Face directory with a config.json (nothing is downloaded)"
        )
    return path


def load(name_or_path: str = "smollm2-135m", *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return ``(model, tokenizer)`` offline, with the kvlocks attention function enabled.

    The model's attention runs transformers' SDPA unless a kvlocks cache asks for sparse decode,
    so the returned model behaves exactly like a stock one with any other cache.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvlocks.integrations.hf import ATTN_NAME, register

    path = resolve(name_or_path)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; allowed {SUPPORTED_TYPES}")
    register()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_NAME, local_files_only=True
    ).to(device)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


__all__ = ["BUNDLED", "SUPPORTED_TYPES", "load", "resolve"]
