"""Learned sinks through the CUDA backend's decoder (:class:`LocksDecoder` with ``sinks``), on the CPU:
a uniform decode batch (the captured path, run in chunks of every plan size the pool allows) and a
mixed batch (FlashAttention's rows kept, the LOCKS rows overwritten) give a float64 softmax over the
attended keys plus the sink logit, row by row. The gpt-oss-like GPU test's heads: Hq 8, Hkv 2, D 64."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (the next test files run kernels)

from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm.cuda.compat import split_flash_kv_cache  # noqa: E402
from kvlocks.integrations.vllm.cuda.step import LocksDecoder, LocksStep, PlanPool, step_lens  # noqa: E402

S, HKV, G, D, NB, W = 16, 2, 4, 64, 160, 24
HQ, SCALE = HKV * G, 64 ** -0.5


def _case(lens, qlens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(NB, S, HKV, 2 * D, generator=gen)  # NHD memory, as vLLM stores it
    keys, values = split_flash_kv_cache(raw.permute(0, 2, 1, 3), HKV, D)
    table = (torch.randperm(NB - 1, generator=gen)[: len(lens) * W] + 1).view(len(lens), W).to(torch.int32)
    qkv = torch.randn(sum(qlens), (HQ + 2 * HKV) * D, generator=gen)
    sinks = torch.rand(HQ, generator=gen) * 4 + 3
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    return raw, keys, values, table, qkv[:, : HQ * D].view(-1, HQ, D), sinks, qsl  # queries: a strided view


def _want(raw, table, n, q, sinks, pages):
    """float64 ``[Hq, D]``: softmax over the listed pages' tokens and the sink, per query head."""
    out = torch.zeros(HQ, D, dtype=torch.float64)
    for h in range(HKV):
        sel = [int(p) for p in pages[h] if int(p) >= 0]
        tok = torch.cat([torch.arange(p * S, min(p * S + S, n)) for p in sel])
        k = raw[table[tok // S].long(), tok % S, h, :D].double()
        v = raw[table[tok // S].long(), tok % S, h, D:].double()
        logits = q[h * G:(h + 1) * G].double() @ k.T * SCALE
        full = torch.cat([logits, sinks[h * G:(h + 1) * G, None].double()], -1)
        out[h * G:(h + 1) * G] = torch.softmax(full, -1)[:, :-1] @ v
    return out


def _decoder(cfg, keys, lens, table, pool, sinks):
    dec = LocksDecoder(cfg, num_kv_heads=HKV, group=G, head_dim=D, scale=SCALE, pool=pool, backend="torch",
                       sinks=sinks)
    store = dec.bind(keys)
    for b, n in enumerate(lens):
        t = torch.arange(n)
        store.note_writes(table[b, t // S].long() * S + t % S)
    return dec


@pytest.mark.parametrize("plan_rows", [1, 2, 8])
def test_uniform_decode_with_sinks_in_chunks(plan_rows):
    """Five decode rows, two over the budget (LOCKS rows) and three within it (every page, exact),
    through the captured path after an eager step, with plans of at most ``plan_rows`` rows (chunks
    1+1+1+1+1, 2+2+1, 4+1)."""
    lens = [300, 37, 161, 17, 250]
    raw, keys, values, table, q, sinks, qsl = _case(lens, [1] * len(lens))
    cfg = LocksConfig(budget=64)  # k = 4 pages: rows of 300 and 250 tokens decode sparsely
    dec = _decoder(cfg, keys, lens, table, PlanPool(max_rows=plan_rows), sinks)
    lt = torch.tensor(lens, dtype=torch.int32)
    sparse, _, locks = step_lens(qsl, lt, S, cfg.pages_per_step)
    assert sparse.tolist() == [True, False, True, False, True]
    step = LocksStep(num_reqs=len(lens), uniform_decode=True, query_start_loc=qsl, seq_lens=lt, block_table=table,
                     sparse=sparse, locks_lens=locks)
    for captured in (False, True):
        out = torch.full((len(lens), HQ, D), float("nan"))
        dec.run(step, q, keys, values, out, captured=captured)
        for b, n in enumerate(lens):
            pages = dec._reference(q[b:b + 1], keys, values, table[b:b + 1], lt[b:b + 1])[0][0]
            if not sparse[b]:
                assert (pages >= 0).sum(-1).tolist() == [-(-n // S)] * HKV
            torch.testing.assert_close(out[b].double(), _want(raw, table[b], n, q[b], sinks, pages),
                                       rtol=1e-4, atol=1e-4)


def test_mixed_batch_with_sinks_overwrites_only_locks_rows():
    """A decode over the budget, a 5-token prefill chunk and a decode within it: the LOCKS row gets the
    sink-corrected attention over its pages; FlashAttention's rows (already sink-corrected) stay."""
    lens, qlens = [300, 90, 40], [1, 5, 1]
    raw, keys, values, table, q, sinks, qsl = _case(lens, qlens, seed=1)
    cfg = LocksConfig(budget=64)
    dec = _decoder(cfg, keys, lens, table, PlanPool(), sinks)
    lt = torch.tensor(lens, dtype=torch.int32)
    sparse, _, locks = step_lens(qsl, lt, S, cfg.pages_per_step)
    step = LocksStep(num_reqs=3, uniform_decode=False, query_start_loc=qsl, seq_lens=lt, block_table=table,
                     sparse=sparse, locks_lens=locks)
    out = torch.randn(sum(qlens), HQ, D)  # what FlashAttention wrote
    before = out.clone()
    dec.run(step, q, keys, values, out, captured=False)
    pages = dec._reference(q[0:1], keys, values, table[0:1], lt[0:1])[0][0]
    torch.testing.assert_close(out[0].double(), _want(raw, table[0], 300, q[0], sinks, pages), rtol=1e-4, atol=1e-4)
    assert torch.equal(out[1:], before[1:])
