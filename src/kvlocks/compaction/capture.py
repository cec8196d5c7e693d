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
the pooled rows are subsampled to ``max_queries`` with a seed, the same rows for every head.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from . import attention

logger = logging.getLogger(__name__)

SELF_STUDY_PROMPTS = (
    "Summarise the text above.",
    "List the facts stated in the text above.",
    "Write three questions that the text above answers.",
)
REPEAT_INSTRUCTION = "Repeat the text above, word for word."


@dataclass(frozen=True, kw_only=True)
class ReferenceConfig:
    """Which passes give reference queries (the cap and seed live in ``CompactionConfig``).

    Parameters
    ----------
    repeat : bool
        Add the "repeat the context" pass. Default True.
    self_study : tuple of str
        Self-study prompts; empty for none.
    self_study_tokens : int
        Greedy answer tokens decoded after each self-study prompt (their queries count); >= 0.
    chat : bool
        Wrap instructions in the tokenizer's chat template (a user turn plus the generation
        prompt) instead of plain text.
    """

    repeat: bool = True
    self_study: tuple[str, ...] = SELF_STUDY_PROMPTS
    self_study_tokens: int = 32
    chat: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.repeat, bool):
            raise ValueError(f"ReferenceConfig.repeat={self.repeat!r}: must be a bool")
        if not isinstance(self.chat, bool):
            raise ValueError(f"ReferenceConfig.chat={self.chat!r}: must be a bool")
        prompts = self.self_study
        if not isinstance(prompts, tuple) or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ValueError(f"ReferenceConfig.self_study={prompts!r}: must be a tuple of non-empty strings")
        n = self.self_study_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"ReferenceConfig.self_study_tokens={n!r}: must be an integer >= 0")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True)
class QueryPass:
    """Tokens fed after the prefix whose queries are recorded.

    Attributes
    ----------
    name : str
    ids : Tensor [1, L], int64
    generate : int
        Greedy tokens decoded after ``ids`` (their queries are recorded too).
    """

    name: str
    ids: torch.Tensor
    generate: int = 0


def _instruction_ids(tokenizer, text: str, chat: bool) -> torch.Tensor:
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = f"\n\n{text}\n"
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids  # [1, L]


def reference_passes(tokenizer, prefix_ids: torch.Tensor, config: ReferenceConfig
                     ) -> list[QueryPass]:
    """The repeat and self-study passes of ``config`` for a prefix ``prefix_ids`` [1, T]."""
    passes = []
    if config.repeat:
        head = _instruction_ids(tokenizer, REPEAT_INSTRUCTION, config.chat)
        passes.append(QueryPass("repeat", torch.cat([head, prefix_ids.cpu()], dim=1)))
    for i, prompt in enumerate(config.self_study):
        ids = _instruction_ids(tokenizer, prompt, config.chat)
        passes.append(QueryPass(f"self_study_{i}", ids, generate=config.self_study_tokens))
    return passes


def _rows(n: int, cap: int, seed: int) -> torch.Tensor | None:
    """Sorted random subset of ``cap`` of ``n`` rows (None: keep all)."""
    if n <= cap:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:cap].sort().values


class QueryRecorder:
    """Collects pooled post-RoPE queries per layer, capped per pass (module docstring).

    Parameters
    ----------
    num_kv_heads : int
        Hkv of the model.
    cap : int
        Rows kept per KV head and pass, and in the final pool.
    seed : int
    """

    def __init__(self, num_kv_heads: int, cap: int, seed: int) -> None:
        self.num_kv_heads, self.cap, self.seed = num_kv_heads, cap, seed
        self._chunks: dict[int, list[torch.Tensor]] = {}
        self._seen: dict[int, int] = {}  # rows per head of the current pass, before any cap
        self.passes: dict[str, dict[int, torch.Tensor]] = {}
        self.counts: dict[str, int] = {}
        self.scales: dict[int, float] = {}

    def add(self, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """Record ``query`` [1, Hq, L, D] of ``layer``, pooled to [Hkv, G*L, D] float32."""
        hkv = self.num_kv_heads
        b, hq, length, d = query.shape
        if b != 1:
            raise ValueError(f"query capture needs batch size 1, got queries {tuple(query.shape)}")
        q = query[0].detach().reshape(hkv, (hq // hkv) * length, d)  # [Hkv, G*L, D]
        self._seen[layer] = self._seen.get(layer, 0) + q.shape[1]
        rows = _rows(q.shape[1], self.cap, self.seed + 7919 * len(self.passes))
        q = q if rows is None else q[:, rows.to(q.device)]
        self._chunks.setdefault(layer, []).append(q.to("cpu", torch.float32))
        self.scales[layer] = float(scaling) if scaling is not None else d ** -0.5

    def finish_pass(self, name: str) -> None:
        """Close the current pass: pool its chunks per layer and cap them."""
        kept = {}
        for layer, chunks in self._chunks.items():
            q = torch.cat(chunks, dim=1)  # [Hkv, m, D]
            self.counts[name] = self._seen[layer]
            rows = _rows(q.shape[1], self.cap, self.seed + 104729 * (len(self.passes) + 1))
            kept[layer] = q if rows is None else q[:, rows]
        self.passes[name] = kept
        self._chunks, self._seen = {}, {}

    def pooled(self, layer: int) -> torch.Tensor:
        """All passes of ``layer`` pooled and subsampled: [Hkv, n <= cap, D] float32."""
        return pool([p[layer] for p in self.passes.values()], self.cap, self.seed)


def pool(parts: list[torch.Tensor], cap: int, seed: int) -> torch.Tensor:
    """Concatenate [Hkv, m_i, D] parts and keep ``cap`` seeded rows (the same for every head)."""
    q = torch.cat(parts, dim=1)  # [Hkv, sum m_i, D]
    rows = _rows(q.shape[1], cap, seed)
    return q if rows is None else q[:, rows]


class RecordingCache(DynamicCache):
    """A ``DynamicCache`` whose keys carry a :class:`QueryRecorder` to the attention function."""

    def __init__(self, model_config, recorder: QueryRecorder | None) -> None:
        super().__init__(config=model_config)
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
    keys, values : tuple of Tensor [Hkv, T, D], model dtype (post-RoPE keys)
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

    def only(self, names) -> "Capture":
        """This capture with reference queries pooled from the passes ``names`` alone."""
        unknown = sorted(set(names) - set(self.by_pass))
        if unknown or not names:
            raise ValueError(f"passes {sorted(names)}: need a non-empty subset of {sorted(self.by_pass)}")
        queries = tuple(pool([self.by_pass[n][i] for n in names], self.max_queries, self.seed)
                        for i in range(len(self.keys)))
        return dataclasses.replace(self, queries=queries)


def check_prefix_ids(prefix_ids) -> torch.Tensor:
    """``prefix_ids`` as int64 [1, T], T >= 1, or a ``ValueError`` saying what is wrong."""
    if not isinstance(prefix_ids, torch.Tensor) or prefix_ids.is_floating_point():
        raise ValueError(f"prefix_ids must be an integer tensor [1, T], got {type(prefix_ids).__name__}"
                         + ("" if not isinstance(prefix_ids, torch.Tensor) else f" {prefix_ids.dtype}"))
    ids = prefix_ids if prefix_ids.dim() == 2 else prefix_ids.reshape(1, -1)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"prefix_ids must have shape [1, T] with T >= 1, got {tuple(prefix_ids.shape)}")
    return ids.to(torch.int64)


@torch.inference_mode()
def _run_pass(model, cache: RecordingCache, ids: torch.Tensor, generate: int) -> None:
    out = model(input_ids=ids.to(model.device), cache=cache, use_cache=True)
    for _ in range(generate):
        nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
        out = model(input_ids=nxt, cache=cache, use_cache=True)


def capture_queries(model, prefix_ids: torch.Tensor, passes: list[QueryPass], *,
                    max_queries: int, seed: int,
                    progress: Callable[[str], None] | None = None) -> Capture:
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
        Called with each pass's name before it runs.

    Returns
    -------
    Capture
    """
    ids = check_prefix_ids(prefix_ids)
    if isinstance(max_queries, bool) or not isinstance(max_queries, int) or max_queries < 1:
        raise ValueError(f"max_queries={max_queries!r}: must be an integer >= 1")
    start = time.perf_counter()
    text = model.config.get_text_config(decoder=True)
    recorder = QueryRecorder(text.num_key_value_heads, max_queries, seed)
    cache = RecordingCache(model.config, recorder)
    num = ids.shape[1]
    with attention.using(model):
        for p in [QueryPass("context", ids)] + list(passes):
            if progress is not None:
                progress(p.name)
            _run_pass(model, cache, p.ids, p.generate)
            recorder.finish_pass(p.name)
            cache.crop(num - cache.get_seq_length())  # back to the T prefix tokens
            logger.info("captured %s: %d queries per KV head", p.name, recorder.counts[p.name])
    layers = range(text.num_hidden_layers)
    return Capture(keys=tuple(cache.layers[i].keys[0].contiguous() for i in layers),  # [Hkv, T, D]
                   values=tuple(cache.layers[i].values[0].contiguous() for i in layers),
                   queries=tuple(recorder.pooled(i) for i in layers),
                   scales=tuple(recorder.scales[i] for i in layers),
                   counts=dict(recorder.counts), prefix_len=num,
                   by_pass={name: tuple(p[i] for i in layers) for name, p in recorder.passes.items()},
                   max_queries=max_queries, seed=seed,
                   seconds=time.perf_counter() - start)
