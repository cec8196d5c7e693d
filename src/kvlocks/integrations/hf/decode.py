"""A plain greedy decode loop where every token after the prefill goes through decode steps.

``model.generate`` prefills the whole prompt densely, so a question at the end of a prompt never
meets sparse selection. Here the context is prefilled densely (as a server would) and the
question, the answer prefix and the answer are fed one token at a time, so selection acts on
every one of them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeResult:
    tokens: list[int]
    logprobs: list[torch.Tensor] = field(default_factory=list)  # next-token log-probs per answer step


# Device-resident ``arange`` tables, so a decode step's token id and position are views into a
# tensor already on the device. ``torch.tensor([[x]], device="cuda")`` is a blocking copy from
# pageable host memory (the host waits for the stream), twice per step; a view costs nothing.
_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def _arange_view(kind: str, device: torch.device, value: int) -> torch.Tensor:
    """``tensor([[value]])`` on ``device`` as a view into a cached int64 arange (no copy)."""
    key = (kind, str(device))
    table = _TABLES.get(key)
    if table is None or value >= table.numel():
        size = max(1024, 2 * (value + 1), 0 if table is None else table.numel())
        table = _TABLES[key] = torch.arange(size, device=device)
    return table[value : value + 1].view(1, 1)


@functools.lru_cache(maxsize=None)
def _forward_params(model_cls: type) -> frozenset[str]:
    """Keyword names of ``forward`` (``inspect`` is too slow to run at every step)."""
    return frozenset(inspect.signature(model_cls.forward).parameters)


def _cache_keyword(model_cls: type) -> str:
    """The keyword ``forward`` takes the cache under (``cache`` in new transformers)."""
    return "cache" if "cache" in _forward_params(model_cls) else "past_key_values"


@torch.inference_mode()
def prefill(model, cache, context_ids: torch.Tensor) -> torch.Tensor:
    """Dense prefill of ``context_ids [1, T]``; returns the last position's logits ``[V]``.

    Only the last position goes through the LM head (``logits_to_keep=1``): all T rows would
    be a [T, V] float tensor (1.6 GB at 8K tokens for a 49K vocabulary) and, on these CPUs,
    about 4 s of a 4K-token prefill's ~19 s.
    """
    kwargs = {_cache_keyword(type(model)): cache}
    if "logits_to_keep" in _forward_params(type(model)):
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=context_ids, use_cache=True, **kwargs)
    return out.logits[0, -1]


@torch.inference_mode()
def step(model, cache, token: int) -> torch.Tensor:
    """One single-token decode step at position ``cache.get_seq_length()``; logits ``[V]`` (float32).

    No host synchronisation and no host-to-device copy: the id and position come from
    device-resident tables (compacted caches report their logical length, so positions
    continue after the T tokens the compacted prefix stands for).
    """
    device = model.device
    ids = _arange_view("ids", device, int(token))
    pos = _arange_view("pos", device, cache.get_seq_length())
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **{_cache_keyword(type(model)): cache})
    return out.logits[0, -1].float()


@torch.inference_mode()
def greedy_answer(
    model,
    cache,
    context_ids: torch.Tensor,
    suffix_ids: list[int],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    keep_logprobs: bool = False,
) -> DecodeResult:
    """Prefill ``context_ids``, decode ``suffix_ids`` token by token, then greedy-generate."""
    if context_ids.shape[-1] == 0:
        raise ValueError("empty context: at least one context token is required")
    logits = prefill(model, cache, context_ids)
    for t in suffix_ids:
        logits = step(model, cache, t)
    tokens: list[int] = []
    result = DecodeResult(tokens)
    for _ in range(max_new_tokens):
        if keep_logprobs:
            result.logprobs.append(torch.log_softmax(logits.float(), dim=-1).cpu())
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        if nxt in eos_ids:
            break
        logits = step(model, cache, nxt)
    return result
