"""Learned sinks on the decode plan's output, as the vLLM backends apply them: the plan's attention
and log-sum-exp (torch backend, and Triton through the interpreter at small sizes) corrected by
``sigmoid(lse - sink)`` equal a softmax over the attended keys plus the sink logit, at budget >=
context (every page: dense attention with a sink) and at a small budget (the selected pages)."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm.sinks import apply_sinks  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build  # noqa: E402

S, HKV, G, D = 16, 2, 2, 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lens]
    perm = torch.randperm(sum(need) + 2, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, p in enumerate(need):
        table[b, :p] = perm[at:at + p].to(torch.int32)
        at += p
    k = torch.randn(perm.numel(), S, HKV, D, generator=gen)
    v = torch.randn(perm.numel(), S, HKV, D, generator=gen)
    q = torch.randn(len(lens), HKV * G, D, generator=gen)
    sinks = torch.randn(HKV * G, generator=gen) * 2 + 1
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32), sinks


def _reference(q, k, v, table, lens, sinks, pages):
    """softmax([logits of the selected pages' valid tokens, sink]) @ V, per row and query head."""
    scale = 1 / math.sqrt(D)
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(q.shape[0]):
        n = int(lens[b])
        for h in range(HKV):
            sel = [int(p) for p in pages[b, h] if int(p) >= 0]
            tok = torch.cat([torch.arange(p * S, min(p * S + S, n)) for p in sel])
            phys = table[b, tok // S].long()
            kk, vv = k[phys, tok % S, h].float(), v[phys, tok % S, h].float()
            for g in range(G):
                hq = h * G + g
                logits = kk @ q[b, hq].float() * scale
                p = torch.softmax(torch.cat([logits, sinks[hq:hq + 1]]), dim=0)[:-1]
                out[b, hq] = p @ vv
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("budget", [1024, 64])
def test_sink_corrected_plan_equals_softmax_with_the_sink(backend, budget):
    lens = [37, 300, 161]
    q, k, v, table, seq, sinks = (t.to(DEV) for t in _case(lens))
    cfg = LocksConfig(budget=budget)
    store = SummaryStore.empty(k.shape[0], HKV, D, cfg, device=DEV)
    full = torch.cat([table[b, : int(seq[b]) // S] for b in range(len(lens))])
    paged_build(k, store, full, cfg, backend="torch")
    plan = DecodePlan(batch=len(lens), num_kv_heads=HKV, group=G, head_dim=D, max_pages=table.shape[1], config=cfg,
                      dtype=q.dtype, device=q.device, backend=backend, scale=1 / math.sqrt(D))
    out, lse = plan.run(q, k, v, store, table, seq)
    got = apply_sinks(out.clone(), lse, sinks)
    want = _reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), seq.cpu(), sinks.cpu(), plan.pages.cpu())
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-4, atol=2e-4)
    if budget >= max(lens):
        assert (plan.pages >= 0).sum(-1).tolist() == [[-(-n // S)] * HKV for n in lens]
