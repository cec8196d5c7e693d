"""The LOCKS CPU backend's forward (its real class, vLLM's own cache-write op and cache layout)
against ``DecodePlan(backend="torch")`` on the same keys in the plan's paged layout: the same
pages (read from the backend's trace) and the same output, in every selection mode the plan runs,
with learned sinks applied as the backend does."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.compat import decoder_attention_type
from kvlocks.integrations.vllm.cpu.backend import LocksCPUAttentionImpl
from kvlocks.integrations.vllm.sinks import apply_sinks
from kvlocks.plan import DecodePlan, paged_build
from kvlocks.summary.store import SummaryStore

S, HKV, G, D, BS, NB = 16, 2, 3, 64, 64, 48
MODES = {
    "flat": {"rerank": 0},
    "rerank": {"rerank": 4},
    "centroid": {"rerank": 16, "rerank_min": 40, "rerank_scores": "centroid"},
}


def impl_for(cfg, sinks, trace):
    """The backend's implementation with the attributes its constructor sets (the constructor needs
    a running vLLM engine's config)."""
    impl = LocksCPUAttentionImpl.__new__(LocksCPUAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = HKV * G, HKV, D, 1 / math.sqrt(D)
    impl.num_queries_per_kv, impl.sinks, impl.attn_type, impl.kv_cache_dtype = G, sinks, decoder_attention_type(), "auto"
    impl.locks, impl.store, impl._store_key, impl.layout, impl._seen_real_write = cfg, None, None, None, False
    impl.trace_path, impl.verify, impl.ignore_tags, impl.kvlocks_decision = str(trace), True, False, None
    impl._dense_tokens = None  # "dense_below" resolved at the first forward
    return impl


def metadata(lens, table):
    r = len(lens)
    return SimpleNamespace(query_start_loc=torch.arange(r + 1, dtype=torch.int32), seq_lens=lens.to(torch.int32),
                           block_table=table.to(torch.int32), num_actual_tokens=r, causal=True)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_backend_forward_is_the_torch_plan(mode, sinks, tmp_path):
    cfg = LocksConfig(budget=128, **MODES[mode])
    gen = torch.Generator().manual_seed(7)
    lens = torch.tensor([1000, 437, 1280])
    perm = torch.randperm(NB, generator=gen)
    table = torch.zeros(3, 20, dtype=torch.int64)
    table[0, :16], table[1, :7], table[2, :20] = perm[:16], perm[16:23], perm[23:43]  # scrambled blocks
    keys = torch.randn(NB, BS, HKV, D, generator=gen) + 2 * torch.randn(NB, 1, HKV, D, generator=gen)
    values = torch.randn(NB, BS, HKV, D, generator=gen)
    q = torch.randn(3, HKV * G, D, generator=gen)
    sink = torch.randn(HKV * G, generator=gen) + 1 if sinks else None
    impl = impl_for(cfg, sink, tmp_path / "trace.jsonl")
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.3.attn")
    kv_cache = torch.zeros(NB, HKV, BS, 2 * D)
    slots = torch.cat([table[r, torch.arange(int(n)) // BS] * BS + torch.arange(int(n)) % BS
                       for r, n in enumerate(lens)])  # every token of every row, written by vLLM's op
    impl.do_kv_cache_update(layer, keys.view(-1, HKV, D)[slots], values.view(-1, HKV, D)[slots], kv_cache, slots)
    last = torch.stack([table[r, (int(n) - 1) // BS] * BS + (int(n) - 1) % BS for r, n in enumerate(lens)])
    output = torch.zeros(3, HKV * G, D)
    impl.forward(layer, q, keys.view(-1, HKV, D)[last], None, kv_cache, metadata(lens, table), output)

    kp, vp = (x.view(NB * BS // S, S, HKV, D) for x in (keys, values))  # the plan's layout, same page ids
    pt = table[:, torch.arange(80) * S // BS] * (BS // S) + (torch.arange(80) * S % BS) // S
    summaries = SummaryStore.empty(kp.shape[0], HKV, D, cfg)
    paged_build(kp, summaries, torch.cat([pt[r, : int(n) // S] for r, n in enumerate(lens)]), cfg, backend="torch")
    plan = DecodePlan(batch=3, num_kv_heads=HKV, group=G, head_dim=D, max_pages=80, config=cfg,
                      dtype=torch.float32, device="cpu", backend="torch")
    ref, lse = plan.run(q, kp, vp, summaries, pt, lens)
    if sinks:
        apply_sinks(ref, lse, sink)
    recs = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [r["seq_len"] for r in recs] == lens.tolist() and all(r["layer"] == 3 for r in recs)
    assert [r["pages"] for r in recs] == plan.pages.tolist()
    assert [r["stale"] for r in recs] == [0, 0, 0] and sum(r["built"] for r in recs) == 62 + 27 + 80
    torch.testing.assert_close(output, ref, rtol=1e-5, atol=1e-5)
