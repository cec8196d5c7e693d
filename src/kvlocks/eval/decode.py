"""A plain greedy decode loop where every token after the prefill goes through decode steps.

``model.generate`` prefills the whole prompt densely, so a question at the end of a prompt never
meets sparse selection. Here the context is prefilled densely (as a server would) and the
question, the answer prefix and the answer are fed one token at a time, so selection acts on
every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlocks.integrations.hf import cache_kwargs


@dataclass
class DecodeResult:
    tokens: list[int]
    logprobs: list[torch.Tensor] = field(default_factory=list)  # next-token log-probs per answer step


@torch.inference_mode()
def prefill(model, cache, context_ids: torch.Tensor) -> torch.Tensor:
    """Dense prefill of ``context_ids [1, T]``; returns the last position's logits ``[V]``."""
    out = model(input_ids=context_ids, use_cache=True, **cache_kwargs(model, cache))
    return out.logits[0, -1]


@torch.inference_mode()
def step(model, cache, token: int) -> torch.Tensor:
    """One single-token decode step; returns logits ``[V]`` (float32)."""
    ids = torch.tensor([[token]], device=model.device)
    pos = torch.tensor([[cache.get_seq_length()]], device=model.device)
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **cache_kwargs(model, cache))
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
