"""Reference queries for compaction: what future queries of a compacted prefix look like.

One dense prefill of the T-token prefix gives each layer's K/V and the context's own
post-RoPE queries. Then, on top of that prefix cache (cropped back to T after each pass):

* a "repeat the context" pass: an instruction, then the prefix's tokens again (positions
  T+1 .. 2T+1), whose queries read the prefix the way a model quoting it would;
* self-study passes: a few prompts (summarise, list facts, ask questions), each followed by
  a short greedy answer whose decode-step queries are recorded too.

Queries are recorded by the ``"kvlocks_compact"`` attention function (:mod:`.attention`)
through the key tensor of a recording cache: no hooks, no patching, and the model's attention
implementation is restored afterwards. Each query head's rows go to its KV head (GQA pool:
query head h reads KV head h // G), every pass is capped at ``max_queries`` rows per head and
the pooled rows are subsampled to ``max_queries`` with a seed, the same rows for every head;
the rows of user-supplied questions (passes named ``question*``) are kept whole ahead of the
subsample.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from . import attention, capture_batch
from .passes import QueryPass
from .recorder import (  # noqa: F401 (re-exported)
    QUESTION_PREFIX, QueryRecorder, _rows, is_question, pool, question_rows,
)
from kvlocks.integrations.hf import cache_kwargs

logger = logging.getLogger(__name__)

class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into a buffer grown by half its size instead of by ``torch.cat``.

    Keys and values are views of the first ``length`` slots. A decode step over a 4,096-token
    cache of the bundled model spent 46 % of its 0.21 s in the 60 concatenations of a growing
    cache (one CPU thread); the self-study passes are such steps.
    """

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._len = 0

    def _view(self) -> None:
        self.keys, self.values = self._k[..., :self._len, :], self._v[..., :self._len, :]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._len + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            old = 0 if self._k is None else self._k.shape[-2]
            cap = max(end, old + old // 2, 256)  # amortised O(1) appends
            k_new = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))  # [B, H, cap, D]
            v_new = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
            if self._k is not None:
                k_new[..., :self._len, :] = self._k[..., :self._len, :]
                v_new[..., :self._len, :] = self._v[..., :self._len, :]
            self._k, self._v = k_new, v_new
        self._k[..., self._len:end, :] = key_states
        self._v[..., self._len:end, :] = value_states
        self._len = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop expects a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self._len = max(0, self._len + tokens_to_remove)
            self._view()


class _GrowingWindowLayer(_GrowingLayer):
    """A sliding-window layer that keeps every token, so passes can be cropped back to the prefix.

    ``is_sliding`` makes transformers build this layer's mask with the window, by cache index:
    a pass after the prefix sees the prefix's last tokens in its window as if it followed it
    directly (the passes' RoPE positions may lie further on; the window layers only shape the
    hidden states that the global layers' recorded queries come from).
    """

    is_sliding = True


class RecordingCache(DynamicCache):
    """A ``DynamicCache`` whose keys carry a :class:`QueryRecorder` to the attention function."""

    def __init__(self, model_config, recorder: QueryRecorder | None) -> None:
        super().__init__(config=model_config)
        self.layers = [_GrowingLayer() if type(x) is DynamicLayer else
                       _GrowingWindowLayer() if isinstance(x, DynamicSlidingWindowLayer) else x for x in self.layers]
        self.recorder = recorder

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.recorder is not None:
            keys._kvlocks_record = self.recorder
        return keys, values


@dataclass(frozen=True)
class Capture:
    """The prefix's K/V and reference queries, per layer.

    Attributes
    ----------
    keys, values : tuple of Tensor [Hkv, T, D], model dtype, on the CPU (post-RoPE keys)
    queries : tuple of Tensor [Hkv, n, D], float32 (pooled over the GQA group, n <= cap)
    scales : tuple of float
        Each layer's logit scale, as its attention received it.
    counts : dict[str, int]
        Rows per KV head each pass produced, before any cap.
    by_pass : dict[str, tuple of Tensor [Hkv, m, D]]
        Each pass's own queries per layer (capped, not pooled): e.g. held-out queries.
    prefix_len : int
        T.
    seconds : float
        Wall time of the capture.
    max_queries, seed : int
        Cap and seed the queries were pooled with.
    questions : tuple of Tensor [Hkv, m, D], float32, or None
        The rows of the question passes among ``queries`` (kept whole by the pool), for the
        selection's question guard (:mod:`kvlocks.compaction.select`); None without question passes.
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    queries: tuple[torch.Tensor, ...]
    scales: tuple[float, ...]
    counts: dict[str, int]
    by_pass: dict[str, tuple[torch.Tensor, ...]]
    prefix_len: int
    seconds: float
    max_queries: int = 4096
    seed: int = 0
    questions: tuple[torch.Tensor, ...] | None = None

    def only(self, names) -> "Capture":
        """This capture with reference queries pooled from the passes ``names`` alone."""
        unknown = sorted(set(names) - set(self.by_pass))
        if unknown or not names:
            raise ValueError(f"passes {sorted(names)}: need a non-empty subset of {sorted(self.by_pass)}")
        names = list(names)
        keep = [is_question(n) for n in names]
        layers = range(len(self.keys))
        queries = tuple(pool([self.by_pass[n][i] for n in names], self.max_queries, self.seed, keep=keep)
                        for i in layers)
        questions = tuple(question_rows([self.by_pass[n][i] for n in names], keep, self.max_queries)
                          for i in layers) if any(keep) else None
        return dataclasses.replace(self, queries=queries, questions=questions)


def check_prefix_ids(prefix_ids) -> torch.Tensor:
    """``prefix_ids`` as int64 [1, T], T >= 1, or a ``ValueError`` saying what is wrong."""
    if not isinstance(prefix_ids, torch.Tensor) or prefix_ids.is_floating_point():
        raise ValueError(f"prefix_ids must be an integer tensor [1, T], got {type(prefix_ids).__name__}"
                         + ("" if not isinstance(prefix_ids, torch.Tensor) else f" {prefix_ids.dtype}"))
    ids = prefix_ids if prefix_ids.dim() == 2 else prefix_ids.reshape(1, -1)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"prefix_ids must have shape [1, T] with T >= 1, got {tuple(prefix_ids.shape)}")
    return ids.to(torch.int64)


# Passes after the prefix run in chunks: a one-shot 8K-token repeat pass over a 16K cache made
# SDPA materialise a [Hq, 8K, 16K] float mask and scores (about 5 GB per layer on the bundled
# model); 1024-token chunks bound that to about 0.6 GB and record the same queries.
PASS_CHUNK = 1024


@torch.inference_mode()
def _run_pass(model, cache: RecordingCache, p: QueryPass, chunk: int) -> None:
    """Feed pass ``p`` on top of the cache's T prefix tokens (cropped back to T after each piece).

    Only the last position goes through the LM head (``logits_to_keep=1``): the bundled model's
    49,152 x 576 head over every token of a 4,096-token pass cost 232 GFLOP, about 16 % of the
    pass, for logits nobody reads.
    """
    ids = p.ids.to(model.device)
    kw = cache_kwargs(model, cache)  # "cache" or "past_key_values", by transformers version
    num = cache.get_seq_length()
    pieces = p.segments or ((ids.shape[1], num),)
    first = 0
    for length, position in pieces:
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            pos = torch.arange(position + start, position + end, device=model.device)[None]  # [1, L]
            out = model(input_ids=ids[:, first + start:first + end], position_ids=pos,
                        use_cache=True, logits_to_keep=1, **kw)
        first += length
        if p.segments:
            cache.crop(num - cache.get_seq_length())
    position = num + ids.shape[1]
    for _ in range(p.generate):
        nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
        out = model(input_ids=nxt, position_ids=torch.tensor([[position]], device=model.device),
                    use_cache=True, logits_to_keep=1, **kw)
        position += 1


def _fit_positions(model, num: int, passes: list[QueryPass]) -> list[QueryPass]:
    """The passes placed within the model's positions, or ``ValueError`` before any work.

    A RoPE model records queries at positions it was never trained on past its
    ``max_position_embeddings``. A repeat span that would end past it (its place in the whole
    repeat is ``T + L + start``: about 2T) runs at the last positions that fit instead, still after
    the prefix; a pass that cannot fit at all is refused.
    """
    from kvlocks.positions import check_context, position_limit

    limit = position_limit(model.config)
    check_context(num, 0, limit, what="prefix to compact")
    if limit is None:
        return list(passes)
    out = []
    for p in passes:
        if p.segments:
            p = dataclasses.replace(p, segments=tuple((n, min(pos, max(limit - n, num))) for n, pos in p.segments))
            end = max(pos + n for n, pos in p.segments)
        else:
            end = num + p.ids.shape[1] + p.generate
        if end > limit:
            raise ValueError(f"the {p.name!r} reference pass reaches position {end}, past the model's {limit} "
                             f"positions: compact a shorter prefix (at most about {limit - (end - num)} tokens; "
                             "kvlocks compact --max-tokens) or shorten the pass")
        out.append(p)
    return out


def capture_queries(model, prefix_ids: torch.Tensor, passes: list[QueryPass], *,
                    max_queries: int, seed: int,
                    progress: Callable[[str], None] | None = None, batch: bool = True) -> Capture:
    """Prefill the prefix and run ``passes`` on top of it, recording every layer's queries.

    Parameters
    ----------
    model : a transformers causal LM (llama-family attention modules with ``layer_idx``)
    prefix_ids : Tensor [1, T], int
    passes : list of QueryPass
        Run one after another after the prefix (each on the prefix alone).
    max_queries : int
        Cap per KV head, per pass and for the pool; >= 1.
    seed : int
    progress : callable(str), optional
        Called with each pass's name before it runs (names joined by " + " for a batch).
    batch : bool
        Run consecutive generating passes (self-study, questions) as one batch
        (:mod:`.capture_batch`; the same rows, to float rounding). Default True.

    Returns
    -------
    Capture
    """
    ids = check_prefix_ids(prefix_ids)
    if isinstance(max_queries, bool) or not isinstance(max_queries, int) or max_queries < 1:
        raise ValueError(f"max_queries={max_queries!r}: must be an integer >= 1")
    start = time.perf_counter()
    text = model.config.get_text_config(decoder=True)
    recorder = QueryRecorder(text.num_attention_heads, text.num_key_value_heads, max_queries, seed)
    cache = RecordingCache(model.config, recorder)
    num = ids.shape[1]
    passes = _fit_positions(model, num, passes)
    with attention.using(model):
        for group in [[QueryPass("context", ids)]] + capture_batch.groups(passes):
            # generating passes as one batch, where every cache layer is a plain growing one
            if len(group) > 1 and batch and all(type(x) is _GrowingLayer for x in cache.layers):
                if progress is not None:
                    progress(" + ".join(p.name for p in group))
                recorder.start_passes([p.ids.shape[1] + p.generate for p in group])
                capture_batch.run_batch(model, cache, RecordingCache(model.config, recorder), group)
                recorder.finish_passes([p.name for p in group])
                logger.info("captured %s together", [p.name for p in group])
                continue
            for p in group:
                if progress is not None:
                    progress(p.name)
                recorder.start_pass(p.ids.shape[1] + p.generate)
                first = cache.get_seq_length() == 0  # the prefix itself: one causal prefill
                _run_pass(model, cache, p, p.ids.shape[1] if first else PASS_CHUNK)
                recorder.finish_pass(p.name)
                cache.crop(num - cache.get_seq_length())  # back to the T prefix tokens
                logger.info("captured %s: %d queries per KV head", p.name, recorder.counts[p.name])
    layers = range(text.num_hidden_layers)
    # on the CPU, like the queries: the fits run there (a CUDA model's K/V would otherwise meet
    # CPU queries in the solvers)
    return Capture(keys=tuple(cache.layers[i].keys[0].cpu().contiguous() for i in layers),  # [Hkv, T, D]
                   values=tuple(cache.layers[i].values[0].cpu().contiguous() for i in layers),
                   queries=tuple(recorder.pooled(i) for i in layers),
                   questions=(tuple(recorder.questions(i) for i in layers)
                              if any(is_question(n) for n in recorder.passes) else None),
                   scales=tuple(recorder.scales[i] for i in layers),
                   counts=dict(recorder.counts), prefix_len=num,
                   by_pass={name: tuple(p[i] for i in layers) for name, p in recorder.passes.items()},
                   max_queries=max_queries, seed=seed,
                   seconds=time.perf_counter() - start)
