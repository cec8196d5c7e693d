"""The decode plan's ``cpu`` backend (the Hugging Face cache's path on CPU tensors) against the
pure-PyTorch references: its scores, its selection, its attention, and whole-model decoding."""

import pytest
import torch

from kvlocks.attention.reference import sparse_decode
from kvlocks.config import LocksConfig
from kvlocks.attention.cpu import paged_decode
from kvlocks.scoring.cpu import ScoringBuffers
from kvlocks.scoring.reference import score_pages_from_summaries
from kvlocks.selection.cpu import select_rows
from kvlocks.selection.topk import select_top_pages
from kvlocks.summary.build import build_summaries


def _keys(b, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hkv, n, d, generator=g) + 0.5 * torch.randn(b, hkv, 1, d, generator=g)


def _summaries(keys, config, s=16):
    pc = keys.shape[2] // s
    return build_summaries(keys[:, :, : pc * s].unflatten(2, (pc, s)), config)


@pytest.mark.parametrize("n,g", [(16, 1), (17, 3), (1000, 4), (1033, 8)])
def test_scores_equal_the_reference_and_grow_by_new_pages_only(n, g):
    config = LocksConfig(budget=64)
    keys = _keys(2, 2, n, 64)
    q = torch.randn(2, 2, g, 64)
    summ = _summaries(keys, config)
    ref = score_pages_from_summaries(q, summ, scale=0.125)  # [B, Hkv, G, Pc]
    buf = ScoringBuffers()
    pc = summ.num_pages
    for upto in sorted({1, pc // 2, pc}):  # incremental syncs, as pages fill
        buf.sync(summ.select_pages(slice(0, upto)))
    assert buf.pages == pc
    got = buf.scores(q.reshape(4, g, 64), 0.125).view(2, 2, g, pc)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    one = ScoringBuffers()
    one.sync(summ)  # one sync of every page gives the same buffers
    torch.testing.assert_close(one.scores(q.reshape(4, g, 64), 0.125), buf.scores(q.reshape(4, g, 64), 0.125))


@pytest.mark.parametrize("sink,recent", [(0, 1), (1, 1), (2, 3)])
@pytest.mark.parametrize("k", [5, 8, 12])
def test_select_pages_equals_the_reference_with_ties(sink, recent, k):
    g = torch.Generator().manual_seed(k + 10 * sink)
    total = 13
    for pc in (total, total - 1):  # without and with a partial last page
        ranking = torch.randint(0, 4, (6, pc), generator=g).float()  # many ties: lower page must win
        ref = select_top_pages(ranking, total, k, sink_pages=sink, recent_pages=recent)
        rows = torch.full((6,), total)
        got = select_rows(ranking, rows * 0 + pc, rows, k, sink_pages=sink, recent_pages=recent)
        assert torch.equal(got.long(), ref)
    short = select_rows(torch.zeros(2, 3), torch.tensor([2, 3]), torch.tensor([3, 3]), 5, sink_pages=sink,
                        recent_pages=recent)  # fewer pages than k: every page, then -1
    assert short.tolist() == [[0, 1, 2, -1, -1]] * 2


@pytest.mark.parametrize("n", [16, 17, 250, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_pages_equals_sparse_decode(n, dtype):
    s, cap = 16, 1024 + 32
    kb, vb = _keys(2, 3, cap, 64, 1).to(dtype), _keys(2, 3, cap, 64, 2).to(dtype)
    kb[:, :, n:] = float("nan")  # unwritten slots must never be read
    vb[:, :, n:] = float("nan")
    q = torch.randn(2, 3, 4, 64).to(dtype)
    total = -(-n // s)
    g = torch.Generator().manual_seed(n)
    k = min(total, 5)
    mid = torch.stack([torch.randperm(max(total - 2, 1), generator=g)[: max(k - 2, 0)] + 1 for _ in range(6)])
    pages = torch.cat([torch.zeros(6, 1, dtype=torch.long), mid, torch.full((6, 1), total - 1)], 1) if total > 2 \
        else torch.arange(total).expand(6, total)
    pages = torch.sort(pages[:, :k] if total > 2 else pages, dim=-1).values.view(2, 3, -1)
    ref, _ = sparse_decode(q, kb[:, :, :n], vb[:, :, :n], pages, s, scale=0.125)
    width = cap // s  # the Hugging Face store's paged view: one KV head per row
    table = torch.arange(6 * width, dtype=torch.int32).view(6, width)
    got, _ = paged_decode(q.reshape(6, 4, 64), kb.view(-1, s, 1, 64), vb.view(-1, s, 1, 64), table,
                          torch.full((6,), n), pages.reshape(6, 1, -1), scale=0.125)
    got = got.view(2, 3, 4, 64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


@pytest.mark.model
def test_cpu_path_equals_the_references_through_the_model(model_tok):
    """Greedy decoding from one prefill: the plan's cpu backend (the default on CPU) and
    backend="torch" (the token-major references) agree on every token, and their logits agree
    closely, through a page fill and a crop."""
    from kvlocks.integrations.hf import LocksCache
    from kvlocks.integrations.hf.decode import prefill, step

    model, tok = model_tok
    ids = tok("The quick brown fox jumps over the lazy dog. " * 40, return_tensors="pt").input_ids[:, :310]
    assert ids.shape[1] == 310
    ref = LocksCache(model.config, method="locks", config=LocksConfig(budget=64), backend="torch")
    logits = prefill(model, ref, ids)
    fast = ref.fork()
    fast.backend = None  # the default: the plan's cpu backend for CPU tensors
    tok_a = tok_b = int(logits.argmax())
    for _ in range(12):  # crosses a page fill (310 -> 322 tokens)
        la, lb = step(model, fast, tok_a), step(model, ref, tok_b)
        torch.testing.assert_close(la, lb, rtol=1e-3, atol=1e-3)
        tok_a, tok_b = int(la.argmax()), int(lb.argmax())
        assert tok_a == tok_b
    assert fast.stats.summary()["bytes_read"] == pytest.approx(ref.stats.summary()["bytes_read"])
    assert fast.layers[0].store.scoring.pages == 20  # the buffers grew by the filled page
    for c in (fast, ref):
        c.crop(-5)  # 317 tokens: page 19 is no longer full; the cpu backend's buffers are rebuilt
    la, lb = step(model, fast, 7), step(model, ref, 7)
    torch.testing.assert_close(la, lb, rtol=1e-3, atol=1e-3)
    assert fast.layers[0].store.scoring.pages == 19
