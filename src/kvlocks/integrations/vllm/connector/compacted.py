"""Compacted-cache files as the KV connector serves them (no vLLM import here).

A request continues a compacted prefix (a ``kvlocks compact`` file: T tokens stored as t entries
per layer and KV head) by

* naming the file in ``kv_transfer_params`` under :data:`PARAM`, and
* starting its prompt with the file's t **placeholder ids** (:func:`placeholder_ids`), followed
  by the new tokens.

The connector reports the t placeholder positions as externally computed and fills them with the
file's keys (re-rotated by ``-(T - t)``, :mod:`.rope`) and values; vLLM computes only the new
tokens. The placeholders are derived from the file's checksum (pseudo-random ids, sha256 counter
mode), so the prompt names *this* file's content: vLLM's prefix cache, which hashes token ids,
can then share placeholder blocks only between requests of the same file, where their content is
identical. :func:`compacted_request` builds both parts.

:func:`read_header` reads the header only (metadata and declared tensor shapes: cheap, for the
scheduler); the worker loads the whole file with :func:`kvlocks.compaction.cachefile.load`, which
validates everything (never unpickles).
:func:`served_model_info` describes the served checkpoint in the file's terms (config hash and
weights hash, as :func:`kvlocks.compaction.prefix.model_info` computes them for a transformers
model) so a file made for another model is refused.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from kvlocks.compaction import cachefile
from kvlocks.compaction.prefix import BIAS_METHODS, ModelInfo, check_info, model_info

PARAM = "kvlocks_cache"  # kv_transfer_params key naming the file


@dataclass(frozen=True)
class FileHeader:
    """A compacted-cache file's metadata (not its tensors, not yet checksum-verified).

    Attributes: ``path``, ``checksum`` (``sha256:...``), ``prefix_len`` (T), ``kept`` (t),
    ``method``, ``round_dtype`` (of the fold; informative), ``model`` (:class:`ModelInfo`).
    """

    path: Path
    checksum: str
    prefix_len: int
    kept: int
    method: str
    round_dtype: str
    model: ModelInfo


def read_header(path: str | Path, served: ModelInfo | None = None) -> FileHeader:
    """Read and check a file's header (:func:`kvlocks.compaction.cachefile.inspect`: metadata and
    declared tensor shapes, no data), against the ``served`` model if given (:func:`check_against`);
    ``ValueError`` (or ``FileNotFoundError``) saying what is wrong."""
    path = Path(path)
    check = None if served is None else (lambda info: check_against(info, served, str(path)))
    meta, cfg, info = cachefile.inspect(path, check)
    return FileHeader(path=path, checksum=meta["checksum"], prefix_len=int(meta["T"]), kept=int(meta["t"]),
                      method=meta["method"], round_dtype=str(cfg.round_dtype), model=info)


def check_servable(header: FileHeader) -> None:
    """``ValueError`` for files whose method keeps a logit bias (vLLM's kernels take none)."""
    if header.method in BIAS_METHODS:
        raise ValueError(f"{header.path}: a {header.method!r} cache keeps a per-key logit bias, which vLLM's "
                         "attention cannot add; compact with --method fold (or drop, drop_refit, merge_fold)")


@functools.lru_cache(maxsize=64)
def _placeholders(checksum: str, kept: int, vocab_size: int) -> tuple[int, ...]:
    out: list[int] = []
    counter = 0
    while len(out) < kept:  # 8 ids per sha256 block
        digest = hashlib.sha256(f"kvlocks-placeholders|{checksum}|{counter}".encode()).digest()
        out.extend(int.from_bytes(digest[i:i + 4], "little") % vocab_size for i in range(0, 32, 4))
        counter += 1
    return tuple(out[:kept])


def placeholder_ids(header: FileHeader, vocab_size: int) -> list[int]:
    """The t token ids that stand for the file's prefix in a request's prompt (any model vocab)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 2")
    return list(_placeholders(header.checksum, header.kept, vocab_size))


def compacted_request(path: str | Path, new_token_ids: list[int], vocab_size: int, *,
                      name: str | None = None) -> tuple[dict, dict]:
    """The prompt and ``kv_transfer_params`` of a request continuing the file at ``path``.

    Parameters
    ----------
    path : the file (read here for its header: t and checksum)
    new_token_ids : list of int, non-empty
        What follows the compacted prefix (the question, a chat turn, ...).
    vocab_size : int
        The served model's vocabulary size (``hf_config.vocab_size``).
    name : str, optional
        How the request names the file to the server (a name under the connector's ``cache_dir``);
        default the absolute path.

    Returns
    -------
    (prompt, kv_transfer_params) : ``{"prompt_token_ids": [t placeholders] + new}``, ``{PARAM: name}``.
    For ``vllm.LLM``: ``llm.generate(prompt, SamplingParams(..., extra_args={"kv_transfer_params":
    params}))``; for the OpenAI server: ``prompt=prompt["prompt_token_ids"]`` and
    ``extra_body={"kv_transfer_params": params}``.
    """
    header = read_header(path)
    check_servable(header)
    new = [int(i) for i in new_token_ids]
    if not new:
        raise ValueError("new_token_ids is empty: a request must add at least one token after the prefix")
    ids = placeholder_ids(header, vocab_size) + new
    return {"prompt_token_ids": ids}, {PARAM: name or str(Path(path).resolve())}


def check_request(name, prompt: list[int] | None, cache_dir: str | None, served: ModelInfo,
                  vocab_size: int) -> FileHeader:
    """The checks of a request naming a file, before anything is scheduled (the connector's
    scheduler and :mod:`.http` run them): the name stays in ``cache_dir``, the file's header is
    valid and made for the ``served`` model, it needs no logit bias, and ``prompt`` (token ids;
    None: not checked, as for a chat request rendered by the server) is the file's t placeholder
    ids followed by at least one new token. ``ValueError`` (or ``FileNotFoundError``) says which."""
    header = read_header(resolve_path(name, cache_dir), served=served)
    check_servable(header)
    if prompt is None:
        return header
    t = header.kept
    if len(prompt) <= t:
        raise ValueError(f"{header.path}: the prompt has {len(prompt)} tokens; it must be the file's "
                         f"t={t} placeholder ids followed by at least one new token")
    if list(prompt[:t]) != placeholder_ids(header, vocab_size):
        raise ValueError(f"{header.path}: the prompt does not start with this file's {t} placeholder ids "
                         "(kvlocks.integrations.vllm.connector.compacted.compacted_request builds them)")
    return header


def resolve_path(name, cache_dir: str | None) -> Path:
    """The file a request names: under ``cache_dir`` when the connector has one (no escaping it),
    otherwise an absolute path."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"kv_transfer_params[{PARAM!r}]={name!r}: must be a non-empty file name")
    if cache_dir:
        root = Path(cache_dir).resolve()
        path = (root / name).resolve()
        if root not in path.parents:
            raise ValueError(f"{name!r} resolves outside the connector's cache_dir {str(root)!r}")
        return path
    path = Path(name)
    if not path.is_absolute():
        raise ValueError(f"{name!r}: give an absolute path (or configure the connector's cache_dir)")
    return path


# ---------------------------------------------------------------- the served model, in the file's terms


def _checkpoint_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in set(names) & set(f.keys()):
                found[name] = f.get_tensor(name)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint has no {missing} (safetensors); cannot check that a "
                         "compacted cache was made for these weights")
    return found


def served_model_info(hf_config, model_dir: str | Path) -> ModelInfo:
    """:class:`ModelInfo` of a local Hugging Face checkpoint, computed by ``model_info`` itself.

    ``model_info`` reads a model's text config and hashes its first layer's ``k_proj`` and last
    layer's ``v_proj`` weights; here those two tensors come from the checkpoint files (vLLM fuses
    the projections in memory), through a minimal stand-in object with the same attributes.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model {str(model_dir)!r} is not a local directory: the connector checks files "
                         "against the checkpoint's weights, so serve a local Hugging Face directory")
    cfg = hf_config.get_text_config(decoder=True)
    last = cfg.num_hidden_layers - 1
    k_name, v_name = "model.layers.0.self_attn.k_proj.weight", f"model.layers.{last}.self_attn.v_proj.weight"
    w = _checkpoint_tensors(model_dir, [k_name, v_name])
    first = SimpleNamespace(self_attn=SimpleNamespace(k_proj=SimpleNamespace(weight=w[k_name])))
    final = SimpleNamespace(self_attn=SimpleNamespace(v_proj=SimpleNamespace(weight=w[v_name])))
    stand_in = SimpleNamespace(config=hf_config, get_decoder=lambda: SimpleNamespace(layers=[first, final]))
    return model_info(stand_in, model_id=str(model_dir))


def check_against(header_model: ModelInfo, served: ModelInfo, where: str) -> None:
    """``ValueError`` unless a file's model is the served one (:func:`kvlocks.compaction.prefix.check_info`)."""
    check_info(header_model, served, where, what="the served model")


__all__ = ["PARAM", "FileHeader", "check_against", "check_request", "check_servable", "compacted_request",
           "placeholder_ids", "read_header", "resolve_path", "served_model_info"]
