"""A vLLM v1 KV connector that continues a compacted (folded) prefix from a ``kvlocks compact`` file.

Load it by module path (no registration, nothing patched)::

    LLM(model=DIR, kv_transfer_config={"kv_connector": "KvlocksConnector",
        "kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"cache_dir": "/srv/caches"}})   # cache_dir optional

A request names its file in ``kv_transfer_params`` (``{"kvlocks_cache": NAME}``) and starts its
prompt with the file's t placeholder ids (:func:`.compacted.compacted_request` builds both).

Scheduler side (once per request, in ``on_new_request``): resolve the name, read the header, check
the file against the served checkpoint (layers, heads, head dim, config and weights hashes), refuse
biased methods, check the prompt's placeholders. A valid request reports its first t positions as
externally computed (minus any local prefix-cache hit) and is loaded synchronously, before the
forward that computes its new tokens. An invalid one is failed through vLLM's own KV-load-failure
path (``kv_load_failure_policy="fail"``, required): it is admitted as an asynchronous load of its
whole prompt that the workers report failed, so it finishes with ``finish_reason="error"`` without
running the model or touching other requests; the reason is logged (and traced).

Worker side (``start_load_kv``): load and fully validate the file (checksum, shapes; never
unpickle; the content must be the one the scheduler checked), re-rotate every kept key by
``-(T - t)`` (:mod:`.rope`), cast to the cache dtype and write this rank's KV heads at the
request's slots through the attention layer's own ``do_kv_cache_update`` (so vLLM keeps its cache
layout, and the LOCKS backend's validity tags see the writes). A failure marks the request's blocks
invalid and vLLM fails the request.

Debug: ``KVLOCKS_VLLM_CONNECTOR_TRACE=path`` appends one JSON line per load and per rejection.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from kvlocks import env
from kvlocks.compaction import cachefile
from kvlocks.integrations.vllm import compat
from kvlocks.integrations.vllm.connector.base import SyncLoadOnly, connector_base_classes, transfer_results
from kvlocks.integrations.vllm.connector.compacted import (
    PARAM,
    FileHeader,
    check_against,
    check_request,
    check_servable,
    read_header,
    served_model_info,
)
from kvlocks.integrations.vllm.connector.rope import key_shifter
from kvlocks.pages import num_pages

log = logging.getLogger(__name__)

_Base, _Metadata, _Role = connector_base_classes()
EXTRA_KEYS = ("cache_dir",)
_PREPARED_FILES = 4  # prepared (re-rotated, cast) files kept per worker


@dataclass
class LoadJob:
    """Write entries ``[start, stop)`` (stop = t) of file ``path`` at cache ``slots``.

    ``blocks`` are the blocks those slots are in (reported as invalid if the load fails; blocks
    before ``start`` came from vLLM's prefix cache and may be shared with other requests).
    """

    request_id: str
    path: str
    checksum: str
    start: int
    stop: int
    slots: list[int]
    blocks: list[int]


@dataclass
class KvlocksConnectorMetadata(_Metadata):
    """Scheduler -> workers, per step: loads to do now, requests to fail."""

    loads: list[LoadJob] = field(default_factory=list)
    rejects: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    header: FileHeader | None = None
    error: str | None = None


def _trace(record: dict) -> None:
    path = env.get("KVLOCKS_VLLM_CONNECTOR_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


class KvlocksConnector(SyncLoadOnly, _Base):
    """Loads compacted prefixes into vLLM's paged cache (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.served = compat.served_model(vllm_config, extra_keys=EXTRA_KEYS)
        if self.served.load_failure_policy != "fail":
            raise ValueError(f"kv_load_failure_policy={self.served.load_failure_policy!r}: the kvlocks connector "
                             "needs 'fail' (a recomputed load would prefill the placeholder ids as text)")
        self.cache_dir = self.served.extra_config.get("cache_dir")
        self.model = served_model_info(self.served.hf_config, self.served.model_dir)
        self.shifter = key_shifter(self.served.hf_config)  # unsupported RoPE: refuse at start-up
        self.is_scheduler = role == _Role.SCHEDULER
        self._plans: dict[str, _Plan] = {}
        self._loads: list[LoadJob] = []
        self._rejects: list[str] = []
        self._layers: dict[str, int] = {}
        self._prepared: OrderedDict[tuple[str, str], list] = OrderedDict()
        self._failed: set[str] = set()
        self._invalid_blocks: set[int] = set()
        log.info("kvlocks connector (%s) for %s, cache_dir=%r", "scheduler" if self.is_scheduler else "worker",
                 self.served.model_dir, self.cache_dir)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # it only loads; nothing is handed off

    # ------------------------------------------------------------ scheduler side

    def on_new_request(self, request) -> None:
        req = compat.request_view(request)
        params = req.kv_transfer_params or {}
        if PARAM not in params:
            return
        try:
            plan = _Plan(header=self._check(req, params[PARAM]))
        except (ValueError, OSError) as exc:
            plan = _Plan(error=str(exc))
            log.error("kvlocks connector: request %s rejected: %s", req.request_id, exc)
            _trace({"request": req.request_id, "rejected": str(exc)})
        self._plans[req.request_id] = plan

    def _check(self, req: compat.RequestView, name) -> FileHeader:
        header = check_request(name, req.prompt_token_ids, self.cache_dir, self.model, self.served.vocab_size)
        if req.skip_reading_prefix_cache:  # vLLM then ignores any external tokens: nothing can be loaded
            raise ValueError("this request skips reading cached tokens (it asks for prompt logprobs): vLLM "
                             "runs it WITHOUT the compacted prefix, computing the placeholder ids as text; "
                             "do not ask for prompt logprobs with a compacted prefix")
        return header

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return 0, False
        if plan.error is not None:  # an async "load" of the rest of the prompt that the workers fail
            return compat.request_num_tokens(request) - num_computed_tokens, True
        return max(plan.header.kept - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or num_external_tokens == 0:
            return
        if plan.error is not None:
            self._rejects.append(request.request_id)
            return
        t, bs = plan.header.kept, self.served.block_size
        start, block_ids = t - num_external_tokens, compat.first_group_block_ids(blocks)
        slots = [block_ids[p // bs] * bs + p % bs for p in range(start, t)]
        self._loads.append(LoadJob(request_id=request.request_id, path=str(plan.header.path),
                                   checksum=plan.header.checksum, start=start, stop=t, slots=slots,
                                   blocks=block_ids[start // bs: num_pages(t, bs)]))

    def build_connector_meta(self, scheduler_output) -> KvlocksConnectorMetadata:
        meta = KvlocksConnectorMetadata(loads=self._loads, rejects=self._rejects)
        self._loads, self._rejects = [], []
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self._plans.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = {name: compat.layer_number(name) for name in kv_caches}
        bad = [name for name, i in layers.items() if i is None or not 0 <= i < self.model.num_layers]
        if bad or len(set(layers.values())) != self.model.num_layers:
            raise compat.VllmCompatError(f"cannot map vLLM's KV cache layers {sorted(kv_caches)[:3]}... onto "
                                         f"{self.model.num_layers} decoder layers (unmapped: {bad[:3]})")
        self._layers = layers

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvlocksConnectorMetadata), type(meta)
        self._failed.update(meta.rejects)
        for job in meta.loads:
            try:
                self._load(job, forward_context)
            except Exception as exc:  # noqa: BLE001 - fail this request (vLLM's failure path), not the engine
                log.exception("kvlocks connector: loading %s for request %s failed", job.path, job.request_id)
                self._invalid_blocks.update(job.blocks)
                _trace({"request": job.request_id, "load_failed": str(exc)})

    def _load(self, job: LoadJob, forward_context) -> None:
        layers = self._prepare(job.path, job.checksum)
        slots = torch.tensor(job.slots, dtype=torch.long)  # [stop - start]
        for name, i in self._layers.items():
            keys, values = layers[i]  # [t, Hkv_local, D] each, cache dtype
            compat.write_kv(compat.attention_layer(forward_context, name), keys[job.start:job.stop],
                            values[job.start:job.stop], slots)
        rank, _ = compat.tensor_parallel()
        _trace({"request": job.request_id, "file": job.path, "start": job.start, "stop": job.stop,
                "rank": rank, "blocks": job.blocks})

    def _prepare(self, path: str, checksum: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: this rank's keys re-rotated by -(T - t) and values, ``[t, Hkv_local, D]``."""
        key = (path, checksum)
        if key in self._prepared:
            self._prepared.move_to_end(key)
            return self._prepared[key]
        prefix = cachefile.load(path)  # validates shapes, indices, checksum of what it read
        _check_content(path, prefix, checksum)
        check_servable(read_header(path))
        check_against(prefix.model, self.model, path)
        rank, world = compat.tensor_parallel()
        heads = compat.local_kv_heads(prefix.model.num_kv_heads, rank, world)
        shift, dtype = prefix.prefix_len - prefix.kept, self.served.cache_dtype
        layers = []
        for i in range(prefix.model.num_layers):
            keys, values, _ = prefix.serving_layer(i)  # [Hkv, t, D] float32
            keys = self.shifter.shift(keys[heads], shift).to(dtype)  # [Hkv_local, t, D]
            layers.append((keys.transpose(0, 1).contiguous(), values[heads].to(dtype).transpose(0, 1).contiguous()))
        self._prepared[key] = layers
        log.info("kvlocks connector: %s (%s, T=%d as t=%d, keys shifted by -%d) ready in %s for KV heads %s",
                 path, prefix.method, prefix.prefix_len, prefix.kept, shift, dtype, heads)
        while len(self._prepared) > _PREPARED_FILES:
            self._prepared.popitem(last=False)
        return layers

    def get_transfer_results(self, finished_req_ids):
        failed, self._failed = self._failed, set()
        return transfer_results(set(), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid


def _check_content(path: str, prefix, checksum: str) -> None:
    """``ValueError`` unless the loaded tensors are the file content the scheduler checked."""
    with safe_open(path, framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
    tensors = {}
    for i in range(prefix.model.num_layers):
        tensors[f"layers.{i}.keys"] = prefix.keys[i]
        tensors[f"layers.{i}.values"] = prefix.values[i]
        tensors[f"layers.{i}.indices"] = prefix.indices[i]
        if prefix.beta is not None:
            tensors[f"layers.{i}.beta"] = prefix.beta[i]
    if meta.get("checksum") != checksum or cachefile.checksum(meta, tensors) != checksum:
        raise ValueError(f"{path}: the file changed after the request was checked (checksum differs)")


__all__ = ["KvlocksConnector", "KvlocksConnectorMetadata", "LoadJob"]
