"""Load a bundled model (``smollm2-135m``, the default, or ``gemma3-270m``) or any local Hugging
Face GQA decoder, offline.

:func:`check` validates a model name or directory without loading anything (the CLI calls it
before the 2-60 s load, so a typo is reported at once); :func:`load` returns the model and
tokenizer; :func:`quiet` silences transformers' and gguf's progress bars and warnings while a
model loads (the CLI uses it unless ``-v``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kvlocks.models.bundled import BUNDLED, check_package, check_tokenizer, converted_dir, is_converted
from kvlocks.models.device import check_device
from kvlocks.models.quiet import quiet

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")  # gemma3_text: hybrid (kvlocks.hybrid)


def check(name_or_path: str) -> Path | None:
    """Validate a model name or directory without loading or converting anything.

    Returns the local directory (``None`` for a bundled model not converted yet). Raises
    ``ValueError`` for an unknown name, a directory without ``config.json`` or of an
    unsupported ``model_type``, and ``FileNotFoundError`` when the bundled model's package is
    missing.
    """
    if name_or_path in BUNDLED:
        if is_converted(name_or_path):
            return converted_dir(name_or_path)
        check_package(name_or_path)  # its package must be installed to convert
        return None
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {name_or_path!r} is neither a bundled model {sorted(BUNDLED)} nor a local "
            "Hugging Face directory with a config.json (nothing is downloaded)"
        )
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"model {name_or_path!r}: config.json is not a readable JSON object ({exc})") from None
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model {name_or_path!r}: model_type {model_type!r} is not supported; "
                         f"allowed {SUPPORTED_TYPES}")
    return path


def resolve(name_or_path: str) -> Path:
    """A bundled model name (converted on first use) or a local Hugging Face directory."""
    if name_or_path in BUNDLED:
        return converted_dir(name_or_path)
    return check(name_or_path)


def load(name_or_path: str = "smollm2-135m", *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return ``(model, tokenizer)`` offline, with the kvlocks attention function enabled.

    The model's attention runs transformers' SDPA unless a kvlocks cache asks for sparse decode,
    so the returned model behaves exactly like a stock one with any other cache. ``device`` is
    checked first (``check_device``): a CUDA device that is not visible is a ``ValueError``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvlocks.integrations.hf import ATTN_NAME, register

    dev = check_device(device)
    path = resolve(name_or_path)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported; allowed {SUPPORTED_TYPES}")
    register()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if name_or_path in BUNDLED:
        check_tokenizer(name_or_path, tok)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_NAME, local_files_only=True
    ).to(dev)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


__all__ = ["BUNDLED", "SUPPORTED_TYPES", "check", "check_device", "is_converted", "load", "quiet", "resolve"]
