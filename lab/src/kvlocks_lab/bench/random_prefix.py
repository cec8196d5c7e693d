"""A benchmark-only vLLM v1 KV connector: the prompt's prefix as random K/V, written into vLLM's paged
KV cache instead of prefilled, so decode at 512K and 1M tokens starts in seconds.

Load it by module path (as kvlocks' own connector, :mod:`kvlocks.integrations.vllm.connector.kv_connector`)::

    LLM(..., kv_transfer_config=kv_transfer_config(seed=0))

Scheduler side: every request's first ``N - 1`` prompt tokens (``N`` = prompt length, less what
vLLM's prefix cache already holds) are reported as externally computed and loaded synchronously,
before the forward that computes the last prompt token; vLLM then caches those blocks like any
loaded prefix (a second request with the same prompt hits them and loads only the tail). The
engine's ``vllm:external_prefix_cache_hits`` counts the loaded tokens; nothing of the prefix is
computed by the model.

Worker side (``start_load_kv``): for each load and each attention layer, random keys and values
(:func:`random_kv`) are written at the request's slots through the layer's own backend
(``kvlocks.integrations.vllm.compat.write_kv``: ``do_kv_cache_update``, then the LOCKS CUDA
backend's ``kvlocks_external_write`` hook, which builds the summaries of every page written whole;
the LOCKS CPU backend builds them at the first decode step from its validity tags). The connector
knows nothing of the attention backend, so FLASH_ATTN and LOCKS decode from the same kind of prefix.

The K/V (float32 draws cast to the cache dtype; bf16 in the TPOT bench) depend only on
``(seed, layer, position)``: generated per aligned chunk of :data:`CHUNK` positions with a generator
seeded from ``(seed, layer, chunk)``, on the cache's device, so a reload of a tail gives the same
entries and nothing of size ``N`` is built on the host. Keys have page structure so that LOCKS's
page scores are not all alike: key ``t`` of KV head ``h`` is ``(u[h, t // 16] + 0.5 * e[h, t]) /
sqrt(1.25)``, ``u`` a direction shared by the 16 tokens of a page, ``e`` per-token noise, all
standard normal (each element has unit variance: the norm of a key is about ``sqrt(D)``, the scale
of real keys); values are standard normal.

``STATS`` (this process; the bench runs an in-process engine core) counts the loads, the tokens
loaded and the seconds spent writing them (device synchronized).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from kvlocks.integrations.vllm import compat
from kvlocks.integrations.vllm.connector.base import SyncLoadOnly, connector_base_classes

log = logging.getLogger(__name__)

_Base, _Metadata, _Role = connector_base_classes()
CONNECTOR = "RandomPrefixConnector"
MODULE = "kvlocks_lab.bench.random_prefix"
CHUNK = 16384  # positions generated at once per layer (a multiple of any block and page size)
PAGE = 16  # tokens sharing one key direction (the LOCKS page size)
NOISE = 0.5  # per-token noise relative to the page direction
EXTRA_KEYS = ("seed",)
STATS = {"loads": 0, "loaded_tokens": 0, "fill_s": 0.0}


def kv_transfer_config(seed: int = 0) -> dict:
    """The ``kv_transfer_config`` that loads this connector."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"seed": int(seed)}}


def claimed_tokens(num_prompt_tokens: int, num_computed_tokens: int) -> int:
    """Tokens the connector loads: the prompt's first ``N - 1`` less those already computed (local
    prefix-cache hits); the last prompt token is always computed (it gives the first output)."""
    return max(num_prompt_tokens - 1 - num_computed_tokens, 0)


def slot_mapping(block_ids: torch.Tensor, block_size: int, start: int, stop: int) -> torch.Tensor:
    """Cache slots ``[stop - start]`` (int64) of positions ``start .. stop-1`` of a request whose
    logical block ``i`` is physical block ``block_ids[i]``."""
    pos = torch.arange(start, stop, dtype=torch.int64, device=block_ids.device)
    return block_ids.long()[pos // block_size] * block_size + pos % block_size


def _chunk_seed(seed: int, layer: int, chunk: int) -> int:
    return (seed * 1_000_003 + layer * 7_919 + chunk * 104_729 + 1) % (2**63 - 1)


def random_chunk(seed: int, layer: int, chunk: int, num_kv_heads: int, head_dim: int,
                 device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[CHUNK, Hkv, D]`` float32 of positions ``chunk * CHUNK ..`` of one layer
    (module docstring: page-structured keys, standard normal values)."""
    gen = torch.Generator(device=device).manual_seed(_chunk_seed(seed, layer, chunk))
    pages = CHUNK // PAGE
    u = torch.randn(pages, 1, num_kv_heads, head_dim, generator=gen, device=device)
    e = torch.randn(pages, PAGE, num_kv_heads, head_dim, generator=gen, device=device)
    keys = ((u + NOISE * e) / math.sqrt(1 + NOISE**2)).reshape(CHUNK, num_kv_heads, head_dim)
    values = torch.randn(CHUNK, num_kv_heads, head_dim, generator=gen, device=device)
    return keys, values


def random_kv(seed: int, layer: int, start: int, stop: int, num_kv_heads: int, head_dim: int,
              dtype=torch.bfloat16, device="cpu"):
    """Yield ``(pos0, keys, values)`` pieces covering positions ``[start, stop)`` of one layer, each
    ``[n, Hkv, D]`` in ``dtype``, inside one aligned chunk: the entry of a position does not depend
    on ``start`` or ``stop``."""
    pos = start
    while pos < stop:
        c = pos // CHUNK
        end = min(stop, (c + 1) * CHUNK)
        keys, values = random_chunk(seed, layer, c, num_kv_heads, head_dim, device)
        lo, hi = pos - c * CHUNK, end - c * CHUNK
        yield pos, keys[lo:hi].to(dtype), values[lo:hi].to(dtype)
        pos = end


@dataclass
class FillJob:
    """Write positions ``[start, stop)`` of a request whose logical blocks are ``block_ids``."""

    request_id: str
    start: int
    stop: int
    block_ids: list[int]


@dataclass
class RandomPrefixMetadata(_Metadata):
    jobs: list[FillJob] = field(default_factory=list)


def _prompt_len(request) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if isinstance(n, int) else len(request.prompt_token_ids or ())


class RandomPrefixConnector(SyncLoadOnly, _Base):
    """Loads every prompt's first ``N - 1`` tokens as random K/V (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.served = compat.served_model(vllm_config, extra_keys=EXTRA_KEYS)
        self.seed = int(self.served.extra_config.get("seed", 0))
        cfg = self.served.hf_config
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._jobs: list[FillJob] = []
        self._layers: dict[str, int] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # it only loads

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return claimed_tokens(_prompt_len(request), num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        stop = _prompt_len(request) - 1
        block_ids = compat.first_group_block_ids(blocks)
        self._jobs.append(FillJob(request_id=request.request_id, start=stop - num_external_tokens, stop=stop,
                                  block_ids=block_ids[: -(-stop // self.served.block_size)]))

    def build_connector_meta(self, scheduler_output) -> RandomPrefixMetadata:
        meta, self._jobs = RandomPrefixMetadata(jobs=self._jobs), []
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        return False, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches)
        self._layers = {name: (compat.layer_number(name) if compat.layer_number(name) is not None else i)
                        for i, name in enumerate(names)}

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RandomPrefixMetadata), type(meta)
        if not meta.jobs:
            return
        t0 = time.perf_counter()
        rank, world = compat.tensor_parallel()
        heads = compat.local_kv_heads(self.num_kv_heads, rank, world)
        device = None
        for job in meta.jobs:
            for name, i in self._layers.items():
                layer = compat.attention_layer(forward_context, name)
                device = layer.kv_cache.device
                blocks = torch.tensor(job.block_ids, dtype=torch.int64, device=device)
                for pos0, keys, values in random_kv(self.seed, i, job.start, job.stop, self.num_kv_heads,
                                                    self.head_dim, self.served.cache_dtype, device):
                    slots = slot_mapping(blocks, self.served.block_size, pos0, pos0 + keys.shape[0])
                    compat.write_kv(layer, keys[:, heads].contiguous(), values[:, heads].contiguous(), slots)
            STATS["loads"] += 1
            STATS["loaded_tokens"] += job.stop - job.start
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        STATS["fill_s"] += time.perf_counter() - t0
        log.info("random prefix: %d loads (%s tokens) in %.2f s", len(meta.jobs),
                 [j.stop - j.start for j in meta.jobs], time.perf_counter() - t0)


__all__ = ["RandomPrefixConnector", "kv_transfer_config", "random_kv", "slot_mapping", "claimed_tokens", "STATS"]
