"""The CUDA LOCKS backend's pieces on the CPU: rows, chunks, the cache layout, the summary store's
tags and the decode paths, against independent references (token-major kvlocks reference functions
on the keys each row owns). The Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from kvlocks.attention.reference import dense_decode, sparse_decode  # noqa: E402
from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm.cuda.compat import split_flash_kv_cache  # noqa: E402
from kvlocks.integrations.vllm.cuda.step import LocksDecoder, LocksStep, PlanPool, binary_chunks, step_lens  # noqa: E402
from kvlocks.integrations.vllm.cuda.store import EXTERNAL, CudaSummaryStore  # noqa: E402
from kvlocks.plan import paged_build  # noqa: E402
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries  # noqa: E402
from kvlocks.selection.topk import select_top_pages  # noqa: E402
from kvlocks.summary.build import build_summaries  # noqa: E402

S, HKV, G, D, NB = 16, 2, 3, 64, 40
CFG = LocksConfig(budget=64, rerank=0)  # k = 4 pages, flat scoring (the reference below)


def test_step_lens_marks_long_single_token_rows():
    qsl = torch.tensor([0, 1, 2, 10, 11, 11], dtype=torch.int32)  # q lens 1, 1, 8, 1, 0 (padding)
    lens = torch.tensor([300, 40, 500, 17, 0], dtype=torch.int32)  # pages 19, 3, 32, 2, 0
    sparse, flash, locks = step_lens(qsl, lens, 16, 4)
    assert sparse.tolist() == [True, False, False, False, False]
    assert flash.tolist() == [1, 40, 500, 17, 0] and locks.tolist() == [300, 0, 0, 0, 0]
    assert flash.dtype == locks.dtype == torch.int32
    _, _, locks = step_lens(qsl, torch.tensor([64, 65, 0, 80, 0], dtype=torch.int32), 16, 4)
    assert locks.tolist() == [0, 65, 0, 80, 0]  # 4 pages fit k = 4; 5 pages do not
    # dense_below is per step: these rows hold 300 + 65 + 0 + 80 = 445 tokens together
    sparse, flash, locks = step_lens(qsl, torch.tensor([300, 65, 0, 80, 0], dtype=torch.int32), 16, 4, 445)
    assert sparse.tolist() == [False] * 5  # at the crossover: every row dense
    assert flash.tolist() == [300, 65, 0, 80, 0] and locks.tolist() == [0] * 5
    sparse, flash, locks = step_lens(qsl, torch.tensor([300, 65, 0, 80, 0], dtype=torch.int32), 16, 4, 444)
    assert sparse.tolist() == [True, True, False, True, False]  # over it: every row past the budget selects
    assert flash.tolist() == [1, 1, 0, 1, 0] and locks.tolist() == [300, 65, 0, 80, 0]


@pytest.mark.parametrize("cap", [1, 2, 8, 16])
def test_binary_chunks_cover_rows_in_powers_of_two(cap):
    assert binary_chunks(24, 16) == [(0, 16), (16, 8)] and binary_chunks(7, 4) == [(0, 4), (4, 2), (6, 1)]
    for n in range(0, 70):
        chunks = binary_chunks(n, cap)
        assert sum(size for _, size in chunks) == n
        assert all(start == sum(s for _, s in chunks[:i]) for i, (start, _) in enumerate(chunks))
        assert all(size <= cap and size & (size - 1) == 0 for _, size in chunks)


def test_plan_pool_cap_follows_budget():
    """Plans of every power of two up to the cap fit the budget; a batch runs as chunks of them."""
    from kvlocks.integrations.vllm.cuda.step import _tensor_bytes

    shape = (HKV, G, D, 64, 0.125, torch.float32, torch.device("cpu"), CFG, "triton", 0)
    assert PlanPool(budget_bytes=1 << 40, max_rows=8).cap(shape) == 8
    per_row = _tensor_bytes(PlanPool()._make(shape, 1))
    assert per_row > 0
    pool = PlanPool(budget_bytes=3 * per_row, max_rows=64)  # plans of 1 and 2 rows: 3 rows' worth
    assert pool.cap(shape) == 2
    pool.prepare(shape, 5)  # chunks 2 + 2 + 1
    assert sorted(size for (_, size) in pool.plans) == [1, 2]
    with pytest.raises(RuntimeError, match="no LOCKS plan for 4 rows"):
        pool.get(shape, 4, create=False)


def _fake_cache(dtype=torch.float32, seed=0):
    """vLLM's FlashAttention cache: memory [NB, BS, Hkv, 2D] (NHD), seen as [NB, Hkv, BS, 2D]."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(NB, S, HKV, 2 * D, generator=gen).to(dtype)
    return raw, raw.permute(0, 2, 1, 3)


def test_split_reads_the_nhd_memory_layout():
    raw, kv = _fake_cache()
    keys, values = split_flash_kv_cache(kv, HKV, D)
    assert keys.shape == values.shape == (NB, S, HKV, D) and keys.stride(-1) == 1
    assert torch.equal(keys, raw[..., :D]) and torch.equal(values, raw[..., D:])
    k5, v5 = split_flash_kv_cache(torch.stack([raw[..., :D], raw[..., D:]]), HKV, D)  # [2, NB, BS, Hkv, D]
    assert torch.equal(k5, keys) and torch.equal(v5, values)
    with pytest.raises(RuntimeError, match="unknown FlashAttention KV cache shape"):
        split_flash_kv_cache(kv, HKV + 1, D)


def _built(keys, pages, backend):
    """A fresh store with ``pages`` built by the same kernels (which pages got built is what is checked;
    the kernels' equivalence with the reference is tests/test_kernels.py's)."""
    st = SummaryStore.empty(NB, HKV, D, CFG)
    paged_build(keys, st, torch.tensor(pages, dtype=torch.int32), CFG, backend=backend)
    return st


def _slots(row_blocks, n):
    tok = torch.arange(n)
    return torch.tensor(row_blocks)[tok // S] * S + tok % S


def bound_step(dec, keys, blocks, lens, qsl, uniform: bool = True) -> LocksStep:
    """Bind ``dec`` to ``keys``, note every row's ``lens`` tokens as written in its ``blocks``, and
    the step over those rows (``step_lens`` marks the rows that select)."""
    store = dec.bind(keys)
    for r in range(len(lens)):
        store.note_writes(_slots(blocks[r].tolist(), int(lens[r])))
    sparse, _, locks = step_lens(qsl, lens, S, dec.config.pages_per_step)
    return LocksStep(num_reqs=len(lens), uniform_decode=uniform, query_start_loc=qsl, seq_lens=lens,
                     block_table=blocks.to(torch.int32), sparse=sparse, locks_lens=locks,
                     max_seq_len=int(lens.max()), decode_rows=int(((qsl[1:] - qsl[:-1]) == 1).sum()))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_tags_catch_rewrites_and_moves(backend):
    raw, kv = _fake_cache()
    keys, _ = split_flash_kv_cache(kv, HKV, D)
    st = CudaSummaryStore(CFG, NB, S, HKV, D, "cpu", backend=backend, verify=True)
    bt = torch.tensor([[3, 7, 1, 9, 0], [3, 7, 12, 0, 0]], dtype=torch.int32)  # row 1 shares two blocks
    lens = torch.tensor([50, 40], dtype=torch.int32)  # full pages: 3 and 2
    st.note_writes(_slots([3, 7, 1, 9], 50))
    st.note_writes(_slots([12], 8) + 0)  # row 1's own block: only partly written
    assert st.ensure(keys, bt, lens, 50).tolist() == [3, 0]  # shared pages built once
    assert torch.equal(st.summaries.coef[[3, 7, 1]], _built(keys, [3, 7, 1], backend).coef[[3, 7, 1]])
    assert st.ensure(keys, bt, lens, 50).tolist() == [0, 0]
    raw[7, :, :, :D] += 1.0  # block 7 rewritten by vLLM (freed and reused): its tags move on
    st.note_writes(_slots([7], 16))
    assert st.ensure(keys, bt, lens, 50).tolist() == [1, 0]
    moved = torch.tensor([[9, 3, 7, 1]], dtype=torch.int32)  # block 3 at another logical page: rebuilt
    assert st.ensure(keys, moved, torch.tensor([64], dtype=torch.int32), 64).tolist() == [4]
    st.check_tags(moved, torch.tensor([64], dtype=torch.int32))
    assert st.counters.tolist()[:3] == [0, 0, 4]
    raw[1, :, :, :D] += 1.0  # a write the tags never saw: only verification can tell
    st.verify_used(keys, moved, torch.tensor([64], dtype=torch.int32))
    assert int(st.counters[1]) == 1


def _summary_fields(st, pages):
    s = st.summaries
    return [t[pages] for t in (s.basis, s.basis_scale, s.coef, s.coef_scale, s.centroid, s.centroid_scale)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_async_ensure_builds_what_ensure_builds_without_reading_back(backend, monkeypatch):
    """The eager path's build (no host sync: a launch over every page up to a host bound on the
    longest row, valid pages skipped) leaves the summaries and tags :meth:`ensure` leaves; a page two
    rows share is counted once per row."""
    raw, kv = _fake_cache(seed=6)
    keys, _ = split_flash_kv_cache(kv, HKV, D)
    a, b = (CudaSummaryStore(CFG, NB, S, HKV, D, "cpu", backend=backend, verify=True) for _ in range(2))
    bt = torch.tensor([[3, 7, 1, 9, 0], [3, 7, 12, 0, 0]], dtype=torch.int32)  # row 1 shares blocks 3 and 7
    lens = torch.tensor([50, 40], dtype=torch.int32)
    for st in (a, b):
        st.note_writes(_slots([3, 7, 1, 9], 50))
        st.note_writes(_slots([12], 8))
    assert b.ensure(keys, bt, lens, 50).tolist() == [3, 0]
    if backend == "triton":  # the kernels' path reads nothing back: any host read fails here
        for name in ("cpu", "item", "tolist", "nonzero", "__bool__", "__int__"):
            monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: {_n}"))
    a.ensure_async(keys, bt, lens, 64)  # a bound above the longest row (50)
    monkeypatch.undo()
    pages = [3, 7, 1]
    assert int(a.async_builds) == 5  # 3 + 2: the shared pages once per row
    for x, y in zip(_summary_fields(a, pages), _summary_fields(b, pages)):
        assert torch.equal(x, y)
    for name in ("built_gen", "built_page", "fingerprints"):
        assert torch.equal(getattr(a, name)[:NB], getattr(b, name)[:NB]), name
    a.ensure_async(keys, bt, lens, 64)
    assert int(a.async_builds) == 5  # every page valid: nothing built
    raw[7, :, :, :D] += 1.0  # block 7 rewritten (freed and reused): rebuilt, for each row holding it
    a.note_writes(_slots([7], 16))
    a.ensure_async(keys, bt, lens, 50)
    assert int(a.async_builds) == 7
    assert all(torch.equal(x, y) for x, y in zip(_summary_fields(a, [7]), _summary_fields(
        type("S", (), {"summaries": _built(keys, [7], backend)})(), [7])))
    a.check_tags(bt, lens)
    assert a.counters.tolist()[:3] == [0, 0, 5]
    a.ensure_async(keys, bt, lens, 0)  # no full page below the bound: no launch
    assert int(a.async_builds) == 7


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_build_new_tags_the_filled_page_and_check_counts_the_rest(backend):
    raw, kv = _fake_cache(seed=1)
    keys, _ = split_flash_kv_cache(kv, HKV, D)
    st = CudaSummaryStore(CFG, NB, S, HKV, D, "cpu", backend=backend)
    bt = torch.tensor([[5, 6, 0], [8, 2, 0], [0, 0, 0]], dtype=torch.int32)
    st.note_writes(_slots([5, 6], 32))
    st.note_writes(_slots([8, 2], 31))
    lens = torch.tensor([32, 31, 0], dtype=torch.int32)  # row 0 filled page 1; row 1 did not; row 2 padding
    st.build_new(keys, bt, lens)
    assert st.built_page[6] == 1 and st.built_gen[6] == st.write_gen[6] and st.built_page[2] == -1
    assert torch.equal(st.summaries.coef[6], _built(keys, [6], backend).coef[6])
    st.check_tags(bt, lens)  # row 0: page 0 never built; row 1: page 0 never built
    assert st.counters.tolist() == [2, 0, 3, 2]


def test_external_write_builds_whole_pages_only():
    raw, kv = _fake_cache(seed=2)
    keys, _ = split_flash_kv_cache(kv, HKV, D)
    st = CudaSummaryStore(CFG, NB, S, HKV, D, "cpu", backend="torch")
    slots = _slots([4, 11, 13], 40)  # two whole pages and 8 tokens of a third
    st.note_writes(slots)
    assert st.external_write(keys, slots) == 2
    assert st.built_page[[4, 11, 13]].tolist() == [EXTERNAL, EXTERNAL, -1]
    bt = torch.tensor([[4, 11, 13]], dtype=torch.int32)
    assert st.ensure(keys, bt, torch.tensor([40], dtype=torch.int32), 40).tolist() == [0]


def _reference_row(raw, blocks, n, q, scale):
    """Token-major reference: the row's keys by its blocks, summaries, Eq. 4, selection, attention."""
    slots = _slots(blocks, n)
    k = raw[slots // S, slots % S, :, :D].transpose(0, 1).float()  # [Hkv, n, D]
    v = raw[slots // S, slots % S, :, D:].transpose(0, 1).float()
    full, total = n // S, -(-n // S)
    summ = build_summaries(k[:, : full * S].reshape(HKV, full, S, D), CFG)
    scores = score_pages_from_summaries(q.view(HKV, G, D).float(), summ, scale=scale)  # [Hkv, G, full]
    pages = select_top_pages(combine_group(scores, CFG.combine), total, CFG.pages_per_step,
                             sink_pages=CFG.sink_pages, recent_pages=CFG.recent_pages)
    out, _ = sparse_decode(q.view(HKV, G, D).float(), k, v, pages, S, scale=scale)
    return out.reshape(HKV * G, D), pages


def _batch(backend, captured_lens=None):
    """Four rows: decode n=100 (LOCKS), decode n=40 (fits k), a 5-token prefill chunk of n=90, decode
    n=129 (LOCKS); or ``captured_lens``, every row one decode token."""
    raw, kv = _fake_cache(seed=3)
    keys, values = split_flash_kv_cache(kv, HKV, D)
    blocks = torch.randperm(NB, generator=torch.Generator().manual_seed(4))[: 4 * 9].view(4, 9)
    lens = torch.tensor(captured_lens or [100, 40, 90, 129], dtype=torch.int32)
    qlen = [1, 1, 1, 1] if captured_lens else [1, 1, 5, 1]
    qsl = torch.tensor([0] + torch.tensor(qlen).cumsum(0).tolist(), dtype=torch.int32)
    dec = LocksDecoder(CFG, num_kv_heads=HKV, group=G, head_dim=D, scale=D ** -0.5, pool=PlanPool(),
                       backend=backend)
    step = bound_step(dec, keys, blocks, lens, qsl, uniform=bool(captured_lens))
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(int(qsl[-1]), HKV * G, D, generator=gen)
    output = torch.randn(int(qsl[-1]), HKV * G, D, generator=gen)  # what FlashAttention wrote
    return raw, keys, values, blocks, lens, qsl, dec, step, query, output


@pytest.mark.parametrize("backend", ["torch"])  # Triton: the eager step of the next test
def test_eager_step_replaces_only_locks_rows(backend, monkeypatch):
    raw, keys, values, blocks, lens, qsl, dec, step, query, output = _batch(backend)
    before = output.clone()
    dec.run(step, query, keys, values, output, captured=False)
    for r, t in ((0, 0), (3, 7)):
        ref, _ = _reference_row(raw, blocks[r].tolist(), int(lens[r]), query[t], D ** -0.5)
        torch.testing.assert_close(output[t], ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(output[1:7], before[1:7])  # the short decode row and the prefill chunk: untouched
    assert int(dec.store.async_builds) == 6 + 2 + 5 + 8  # every full page of every row, once
    again = dataclasses.replace(step, max_seq_len=None)  # no host bound: read back, same result
    dec.run(again, query, keys, values, output, captured=False)
    assert int(dec.store.async_builds) == 21 and dec.store.builds == 0
    import kvlocks.integrations.vllm.cuda.step as step_module

    fresh = _batch(backend)
    monkeypatch.setattr(step_module, "ASYNC_BUILD_ITEMS", 4 * 9 * HKV - 1)  # 4 rows x 9 pages x Hkv: over it
    fresh[6].run(fresh[7], fresh[8], fresh[1], fresh[2], fresh[9], captured=False)
    assert fresh[6].store.builds == 21 and int(fresh[6].store.async_builds) == 0  # stale pages gathered first
    torch.testing.assert_close(fresh[9], output)


def test_a_prefill_step_builds_its_pages_and_reads_nothing_back(monkeypatch):
    """A step without single-token rows (``decode_rows`` 0): the pages it filled are built, no LOCKS
    row is looked for, and nothing is read back to the host (the kernels' path)."""
    raw, keys, values, blocks, lens, qsl, dec, step, query, output = _batch("triton")
    prefill = dataclasses.replace(step, decode_rows=0, sparse=torch.zeros_like(step.sparse))
    before = output.clone()
    for name in ("cpu", "item", "tolist", "nonzero", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host read: {_n}"))
    dec.run(prefill, query, keys, values, output, captured=False)
    monkeypatch.undo()
    assert torch.equal(output, before) and dec.eager_steps == 0  # FlashAttention's rows stand
    assert int(dec.store.async_builds) == 6 + 2 + 5 + 8


@pytest.mark.parametrize("backend", ["torch"])  # Triton: the captured test below
def test_uniform_decode_step_attends_every_row(backend):
    """A batch of single-token decodes outside a graph: FlashAttention did not run, so every row is
    written: the LOCKS rows (n = 100, 90, 129) as the token-major reference selects and attends, the
    row that fits the budget (n = 40) over all its pages (the reference's selection keeps them all)."""
    raw, keys, values, blocks, lens, qsl, dec, step, query, output = _batch(backend, [100, 40, 90, 129])
    dec.run(step, query, keys, values, output, captured=False)
    chosen = []
    for r in range(4):
        ref, pages = _reference_row(raw, blocks[r].tolist(), int(lens[r]), query[r], D ** -0.5)
        torch.testing.assert_close(output[r], ref, atol=2e-5, rtol=2e-5)
        chosen.append(pages.shape[-1])
    assert chosen == [4, 3, 4, 4]  # k = 4 pages; the n = 40 row has 3, all attended
    assert dec.eager_steps == 1 and int(dec.store.async_builds) == 6 + 2 + 5 + 8  # every full page of every row, once


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_steps_below_the_crossover_attend_every_page(backend):
    """A uniform decode step of rows n = 100, 40, 90, 129 (359 tokens): with ``dense_below`` 359 every
    row gets exact attention over all its pages (the plans sized for the crossover); with 358 the
    rows past the budget (100, 90, 129) get the token-major reference's selected pages and the row
    that fits the budget (40) all of its pages."""
    raw, keys, values, blocks, lens, qsl, dec, step, query, output = _batch(backend, [100, 40, 90, 129])
    for dense_below, want in ((359, [False] * 4), (358, [True, False, True, True])):
        dec.dense_below = dense_below
        sparse, _, locks = step_lens(qsl, lens, S, CFG.pages_per_step, dec.dense_below)
        assert sparse.tolist() == want
        step = dataclasses.replace(step, sparse=sparse, locks_lens=locks)
        output.zero_()
        dec.run(step, query, keys, values, output, captured=False)
        for r in range(4):
            ref, pages = _reference_row(raw, blocks[r].tolist(), int(lens[r]), query[r], D ** -0.5)
            if want[r]:
                assert pages.shape[-1] == CFG.pages_per_step
            else:  # every page: dense attention
                slots = _slots(blocks[r].tolist(), int(lens[r]))
                k = raw[slots // S, slots % S, :, :D].transpose(0, 1).float()
                v = raw[slots // S, slots % S, :, D:].transpose(0, 1).float()
                ref, _ = dense_decode(query[r].view(HKV, G, D).float(), k, v, scale=D ** -0.5)
                ref = ref.reshape(HKV * G, D)
            torch.testing.assert_close(output[r], ref, atol=2e-5, rtol=2e-5)
        plan = dec.pool.get(dec.shape(step.block_table.shape[1], query.dtype, query.device), 4, create=False)
        if backend == "triton":
            assert plan.attend_ws.dense_splits >= plan.attend_ws.splits


@pytest.mark.parametrize("backend", ["triton"])  # captured steps run the Triton kernels only (CUDA)
def test_captured_step_builds_the_filled_page_and_matches_eager(backend, tmp_path):
    """An eager step, then a captured one in which rows 0 and 3 fill a page (n = 112, 144): both give the
    token-major reference's outputs on every row (the LOCKS rows over their selected pages, the row
    that fits the budget over all), and the tags of every page used stay valid. The eager step's trace
    holds the LOCKS rows' kernel pages, the reference's pages and its ranking."""
    raw, keys, values, blocks, lens, qsl, dec, step, query, output = _batch(backend, [111, 40, 90, 143])
    shape = dec.shape(step.block_table.shape[1], query.dtype, query.device)
    dec.pool.prepare(shape, 4)  # the metadata builder's part, before any forward
    eager = output.clone()
    dec.trace_path = str(tmp_path / "trace.jsonl")
    dec.run(step, query, keys, values, eager, captured=False)  # builds every full page, as prefill would
    recs = [json.loads(line) for line in open(dec.trace_path)]
    assert [r["seq_len"] for r in recs] == [111, 90, 143]
    for rec, r in zip(recs, (0, 2, 3)):
        ref, pages = _reference_row(raw, blocks[r].tolist(), int(lens[r]), query[r], D ** -0.5)
        torch.testing.assert_close(eager[r], ref, atol=2e-5, rtol=2e-5)
        assert rec["pages"] == rec["ref_pages"] == pages.tolist()
        assert [len(h) for h in rec["ranking"]] == [int(lens[r]) // S] * HKV
    dec.trace_path = None
    ref1, _ = _reference_row(raw, blocks[1].tolist(), int(lens[1]), query[1], D ** -0.5)
    torch.testing.assert_close(eager[1], ref1, atol=2e-5, rtol=2e-5)
    assert dec.store.builds == 6 + 2 + 5 + 8
    lens2 = lens + torch.tensor([1, 1, 1, 1], dtype=torch.int32)  # one more token each
    for r in range(4):
        dec.store.note_writes(_slots(blocks[r].tolist(), int(lens2[r]))[-1:])
    sparse, _, locks = step_lens(qsl, lens2, S, CFG.pages_per_step)
    step2 = LocksStep(num_reqs=4, uniform_decode=True, query_start_loc=qsl, seq_lens=lens2,
                      block_table=step.block_table, sparse=sparse, locks_lens=locks)
    dec.check = True
    dec.run(step2, query, keys, values, output, captured=True)
    for r in range(4):  # rows 0 and 3 (n = 112, 144) just filled their last page; n = 41 fits the budget
        ref, _ = _reference_row(raw, blocks[r].tolist(), int(lens2[r]), query[r], D ** -0.5)
        torch.testing.assert_close(output[r], ref, atol=2e-5, rtol=2e-5)
    assert dec.store.counters.tolist() == [0, 0, 7 + 5 + 9, 3]  # every used page's tags valid


MODES = {"flat": {"rerank": 0}, "rerank": {"rerank": 2}, "centroid": {"rerank": 2, "rerank_min": 3, "rerank_scores": "centroid"}}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_decode_step_selects_the_token_major_reference_pages_in_every_mode(mode, backend, tmp_path):
    """A uniform decode step of the CUDA backend's decoder (its DecodePlans; Triton through the
    interpreter) for each selection mode: the traced pages of every LOCKS row are the plan's torch
    backend's (``ref_pages``) and the token-major reference's (choose_pages on the row's keys and the
    store's summaries), and the outputs attend them."""
    from kvlocks.selection.selectors import LayerView, choose_pages, get_selector

    cfg = LocksConfig(budget=64, **MODES[mode])
    raw, kv = _fake_cache(seed=6)
    keys, values = split_flash_kv_cache(kv, HKV, D)
    blocks = torch.randperm(NB, generator=torch.Generator().manual_seed(7))[: 3 * 9].view(3, 9).to(torch.int32)
    lens = torch.tensor([140, 40, 97], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    dec = LocksDecoder(cfg, num_kv_heads=HKV, group=G, head_dim=D, scale=D ** -0.5, pool=PlanPool(), backend=backend)
    step = bound_step(dec, keys, blocks, lens, qsl)
    query = torch.randn(3, HKV * G, D, generator=torch.Generator().manual_seed(8)) * 2
    output = torch.zeros_like(query)
    dec.trace_path = str(tmp_path / "trace.jsonl")
    dec.run(step, query, keys, values, output, captured=False)
    recs = [json.loads(line) for line in open(dec.trace_path)]
    assert [r["seq_len"] for r in recs] == [140, 97]
    for rec, r in zip(recs, (0, 2)):
        n = int(lens[r])
        slots = _slots(blocks[r].tolist(), n)
        k = raw[slots // S, slots % S, :, :D].transpose(0, 1)  # [Hkv, n, D]
        v = raw[slots // S, slots % S, :, D:].transpose(0, 1)
        view = LayerView(keys=k, summaries=dec.store.summaries.gather(blocks[r, : n // S]), token_mask=None,
                         scale=D ** -0.5)
        q = query[r].view(HKV, G, D)
        pages = choose_pages(q, view, cfg, get_selector("locks"))
        assert rec["pages"] == rec["ref_pages"] == pages.tolist()
        exp, _ = sparse_decode(q, k, v, pages, S, scale=D ** -0.5)
        torch.testing.assert_close(output[r], exp.reshape(HKV * G, D), atol=2e-5, rtol=2e-5)


def test_plan_pool_takes_the_plugins_kernel_options(monkeypatch):
    """``$KVLOCKS_VLLM_CONFIG``'s "kernels" object reaches every DecodePlan of the CUDA backend."""
    from kvlocks.config import KernelOptions
    from kvlocks.integrations.vllm.settings import ENV_VAR

    monkeypatch.setenv(ENV_VAR, json.dumps({"budget": 64, "kernels": {"score_kernel": "packed", "pdl": False}}))
    shape = (HKV, G, D, 64, 0.125, torch.float32, torch.device("cpu"), CFG, "torch", 0)
    plan = PlanPool().get(shape, 1)
    assert plan.options == KernelOptions(score_kernel="packed", pdl=False)
    own = KernelOptions(score_kernel="mma", pdl=False)
    assert PlanPool(options=own).get(shape, 2).options is own
    monkeypatch.setenv(ENV_VAR, json.dumps({"kernels": {"score_kernel": "fast"}}))
    with pytest.raises(ValueError, match="kernels"):
        PlanPool().get(shape, 1)


def test_batch_view_reads_the_host_bounds_vllm_keeps():
    """``max_seq_len`` and ``query_start_loc_cpu`` (host copies in vLLM's metadata) give the step's host
    bound on the longest row and its single-token rows; a vLLM without them leaves both None."""
    from types import SimpleNamespace

    from kvlocks.integrations.vllm.cuda.compat import batch_view

    qsl = torch.tensor([0, 1, 9, 10, 10], dtype=torch.int32)  # 3 rows (1, 8, 1 tokens) and padding
    common = SimpleNamespace(num_reqs=3, num_actual_tokens=10, max_query_len=8, query_start_loc=qsl,
                             seq_lens=torch.tensor([300, 8, 41, 0], dtype=torch.int32),
                             block_table_tensor=torch.zeros(4, 20, dtype=torch.int32))
    bare = batch_view(common)
    assert bare.max_seq_len is None and bare.decode_rows is None
    view = batch_view(SimpleNamespace(**vars(common), max_seq_len=300, query_start_loc_cpu=qsl.clone()))
    assert (view.max_seq_len, view.decode_rows, view.num_reqs) == (300, 2, 3)
