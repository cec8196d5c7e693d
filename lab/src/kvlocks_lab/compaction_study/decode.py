"""Continue a record from a cache: answer-token log-probs (teacher-forced) and a greedy answer.

Every method, ``full`` included, is run the same way: one forward of the suffix followed by
full's answer minus its last token gives the next-token distributions at the m answer
positions (teacher forcing on full's answer). If a method's arg-max agrees with full's token at
every answer position, its greedy answer *is* full's answer (the greedy path and the
teacher-forced path coincide), so no decode is needed; otherwise it is decoded greedily from a
fresh cache. Compacted caches come from :func:`~.serve.to_cache`: ``fold``/``drop``/
``drop_refit``/``merge_fold`` run on stock SDPA, ``am``/``rank1`` on the bias-aware attention
of :mod:`.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvlocks.integrations.hf import cache_kwargs


@dataclass(frozen=True)
class Continuation:
    """One method's continuation of a record.

    Attributes
    ----------
    logp : Tensor [m, V], float32
        Next-token log-probabilities at full's m answer positions.
    tokens : list of int
        The method's own greedy answer.
    decoded : bool
        Whether a greedy decode was needed (False: it agreed with full at every position).
    """

    logp: torch.Tensor
    tokens: list[int]
    decoded: bool


@torch.inference_mode()
def teacher_forced(model, cache, suffix_ids: list[int], answer: list[int]) -> torch.Tensor:
    """Log-probs ``[m, V]`` predicting each of the m answer tokens after ``suffix_ids``."""
    if not suffix_ids or not answer:
        raise ValueError(f"need a non-empty suffix and answer, got {len(suffix_ids)} and {len(answer)} tokens")
    ids = torch.tensor([list(suffix_ids) + list(answer[:-1])], device=model.device)  # [1, s+m-1]
    # only the m answer positions go through the LM head (49152 x 576 on the bundled model)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=len(answer),
                   **cache_kwargs(model, cache)).logits[0]
    return torch.log_softmax(logits[-len(answer):].float(), dim=-1).cpu()  # [m, V]


@torch.inference_mode()
def greedy(model, cache, suffix_ids: list[int], *, max_new_tokens: int,
           eos_ids: set[int]) -> list[int]:
    """Greedy answer after ``suffix_ids`` (stops after an EOS id or ``max_new_tokens``)."""
    device = model.device
    out = model(input_ids=torch.tensor([list(suffix_ids)], device=device), use_cache=True,
                logits_to_keep=1, **cache_kwargs(model, cache))
    tokens: list[int] = []
    for i in range(max_new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        if nxt in eos_ids or i == max_new_tokens - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True,
                    **cache_kwargs(model, cache))
    return tokens


def continue_record(model, make_cache: Callable[[], object], suffix_ids: list[int],
                    answer: list[int], *, max_new_tokens: int, eos_ids: set[int]) -> Continuation:
    """Teacher-forced log-probs on full's ``answer`` and the method's greedy answer.

    Parameters
    ----------
    make_cache : callable() -> cache
        A fresh cache of the method's prefix each call (at most two calls).
    suffix_ids, answer : list of int
        The record's suffix and full's greedy answer (m >= 1 tokens).
    """
    logp = teacher_forced(model, make_cache(), suffix_ids, answer)  # [m, V]
    if logp.argmax(dim=-1).tolist() == list(answer):
        return Continuation(logp=logp, tokens=list(answer), decoded=False)
    tokens = greedy(model, make_cache(), suffix_ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    return Continuation(logp=logp, tokens=tokens, decoded=True)
