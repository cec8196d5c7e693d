"""Queries of the compaction study: fit / near split of the reference queries, and far queries.

* Fit and near. The reference capture (:func:`~.capture.capture_queries`: prefill, repeat and
  self-study passes) records each pass's queries per layer and KV head. A seeded ``heldout``
  fraction of the *context pass's* rows (the prefill's own queries, pooled over the GQA group)
  is set aside as the **near** queries; the fit pools the rest of the context pass with every
  other pass, capped at ``max_queries`` with the same seed for every head.
* Far. Starting from the full cache of the prefix, the record's suffix (question, assistant
  header, answer prefix) is fed, the full cache's greedy answer is decoded, then ``far``
  natural-text tokens follow. Every one of these tokens' queries is recorded, in token order,
  with its distance ``delta`` (1 for the first token after the prefix): the **far** queries.
  The same run gives full's answer tokens, which every method is teacher-forced on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvlocks.integrations.hf import cache_kwargs

from kvlocks.integrations.hf.compaction import attention
from kvlocks.integrations.hf.compaction.capture import PASS_CHUNK, Capture, QueryRecorder, RecordingCache, pool


@dataclass(frozen=True)
class QuerySplit:
    """Fit and near queries of every layer.

    Attributes
    ----------
    fit : tuple of Tensor [Hkv, n_fit, D], float32
        Reference queries the compaction fits on (<= max_queries rows).
    near : tuple of Tensor [Hkv, n_near, D], float32
        Held-out rows of the context pass (never seen by a fit).
    """

    fit: tuple[torch.Tensor, ...]
    near: tuple[torch.Tensor, ...]


def split_queries(capture: Capture, heldout: float, max_queries: int, seed: int) -> QuerySplit:
    """Hold out ``heldout`` of the context pass's rows (module docstring).

    The held-out rows are the same for every layer and head (one seeded permutation of the
    context pass's rows), and so are the fit pool's rows.
    """
    if "context" not in capture.by_pass:
        raise ValueError(f"capture has no 'context' pass; passes: {sorted(capture.by_pass)}")
    if not 0.0 < heldout < 1.0:
        raise ValueError(f"heldout={heldout!r}: must be in (0, 1)")
    rows = capture.by_pass["context"][0].shape[1]
    n_near = int(round(heldout * rows))
    if not 1 <= n_near < rows:
        raise ValueError(f"heldout={heldout} of {rows} context queries leaves no near or no fit rows")
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + 104729))
    near_rows, fit_rows = perm[:n_near].sort().values, perm[n_near:].sort().values
    others = [name for name in capture.by_pass if name != "context"]
    fit, near = [], []
    for layer, ctx in enumerate(capture.by_pass["context"]):
        near.append(ctx[:, near_rows])
        parts = [ctx[:, fit_rows]] + [capture.by_pass[n][layer] for n in others]
        fit.append(pool(parts, max_queries, seed))
    return QuerySplit(fit=tuple(fit), near=tuple(near))


@dataclass(frozen=True)
class FullContinuation:
    """The full cache's continuation of one record.

    Attributes
    ----------
    answer : list of int
        Full's greedy answer tokens (ending with an EOS id, or ``max_new_tokens`` long).
    far : tuple of Tensor [Hkv, L*G, D], float32
        Queries of every continuation token, token-major (row r is token r // G).
    delta : Tensor [L*G], int64
        Distance of each row's token from the end of the prefix (1 = first token after it).
    suffix_len, far_len : int
        Suffix tokens and natural-text tokens in the continuation. L = suffix_len +
        len(answer) - 1 tokens are fed, plus 1 + far_len when far text follows (the answer's
        last token is fed only then).
    """

    answer: list[int]
    far: tuple[torch.Tensor, ...]
    delta: torch.Tensor
    suffix_len: int
    far_len: int


def full_cache(model, capture: Capture, cache_class=DynamicCache, **kwargs) -> DynamicCache:
    """A fresh cache holding the prefix's full K/V (no second prefill)."""
    cache = cache_class(model.config, **kwargs) if kwargs else cache_class(config=model.config)
    for i, (k, v) in enumerate(zip(capture.keys, capture.values)):
        cache.update(k[None].to(model.device, model.dtype), v[None].to(model.device, model.dtype), i)
    return cache


@torch.inference_mode()
def continue_full(model, capture: Capture, suffix_ids: list[int], far_ids: list[int], *,
                  max_new_tokens: int, eos_ids: set[int]) -> FullContinuation:
    """Feed suffix, greedy answer and ``far_ids`` after the full prefix; record every query."""
    if not suffix_ids:
        raise ValueError("suffix_ids is empty: the continuation needs at least one token")
    text = model.config.get_text_config(decoder=True)
    group = text.num_attention_heads // text.num_key_value_heads
    recorder = QueryRecorder(text.num_attention_heads, text.num_key_value_heads, cap=2 ** 62, seed=0)
    cache = full_cache(model, capture, RecordingCache, recorder=None)
    cache.recorder = recorder
    device = model.device
    answer: list[int] = []
    with attention.using(model):
        out = model(input_ids=torch.tensor([suffix_ids], device=device), use_cache=True,
                    logits_to_keep=1, **cache_kwargs(model, cache))
        for i in range(max_new_tokens):
            nxt = int(out.logits[0, -1].argmax())
            answer.append(nxt)
            if nxt in eos_ids or i == max_new_tokens - 1:
                break
            out = model(input_ids=torch.tensor([[nxt]], device=device), use_cache=True,
                        **cache_kwargs(model, cache))
        tail = [answer[-1]] + list(far_ids) if far_ids else []
        for start in range(0, len(tail), PASS_CHUNK):
            model(input_ids=torch.tensor([tail[start:start + PASS_CHUNK]], device=device),
                  use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    recorder.finish_pass("far")
    far = tuple(recorder.passes["far"][i] for i in range(text.num_hidden_layers))
    tokens = far[0].shape[1] // group
    delta = torch.arange(1, tokens + 1).repeat_interleave(group)  # [L*G]
    return FullContinuation(answer=answer, far=far, delta=delta, suffix_len=len(suffix_ids),
                            far_len=len(far_ids) if far_ids else 0)
