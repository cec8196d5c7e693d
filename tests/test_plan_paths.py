"""Every path of a decode step selects the pages of the plan's ``torch`` backend (the spec).

The ``torch`` backend of :class:`kvlocks.plan.DecodePlan` runs, per sequence, the reference
functions :mod:`kvlocks.api` is built on; here the ``cpu`` and ``triton`` backends (the latter
through the Triton interpreter at small sizes), the precomputed-ranking entry (``run_ranked``),
the Hugging Face cache on CPU and through its kernel path, and the sparse-row rule are checked
against it for the flat, re-rank and centroid modes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.plan import DecodePlan, paged_build, paged_score, sparse_lens, sparse_rows  # noqa: E402
from kvlocks.scoring.cpu import ScoringBuffers  # noqa: E402
from kvlocks.scoring.reference import combine_group, score_pages_from_summaries  # noqa: E402
from kvlocks.selection.topk import select_top_pages  # noqa: E402

S = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODES = {
    "flat": {},
    "rerank": {"rerank": 2},
    "centroid": {"rerank": 2, "rerank_min": 3, "rerank_scores": "centroid"},
}


def paged(lens, hkv, g, d, *, seed=0, extra=3):
    """Random K/V in a shuffled paged cache ``[num_pages, S, Hkv, D]``, block table, queries."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // S) for n in lens]
    num_pages = sum(need) + extra
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for b, p in enumerate(need):
        table[b, :p] = perm[at : at + p].to(torch.int32)
        at += p
    k = torch.randn(num_pages, S, hkv, d, generator=gen) + 0.7 * torch.randn(num_pages, 1, hkv, d, generator=gen)
    v = torch.randn(num_pages, S, hkv, d, generator=gen)
    q = torch.randn(len(lens), hkv * g, d, generator=gen) * 1.5
    return [t.to(DEV) for t in (q, k, v, table, torch.tensor(lens, dtype=torch.int32))]


def store_of(k, table, seq, cfg):
    store = SummaryStore.empty(k.shape[0], k.shape[2], k.shape[3], cfg, device=k.device)
    full = torch.cat([table[b, : int(seq[b]) // S] for b in range(len(seq))])
    paged_build(k, store, full, cfg, backend="torch")
    return store


def plan_for(backend, cfg, q, k, table, **kw):
    return DecodePlan(batch=q.shape[0], num_kv_heads=k.shape[2], group=q.shape[1] // k.shape[2], head_dim=q.shape[2],
                      max_pages=table.shape[1], config=cfg, dtype=q.dtype, device=q.device, backend=backend, **kw)


def test_sparse_rows_is_one_token_over_more_pages_than_a_step_reads():
    cfg = LocksConfig(budget=64)  # k = 4 pages
    qlen = torch.tensor([1, 1, 1, 5, 1])
    lens = torch.tensor([64, 65, 10, 1000, 49])
    got = sparse_rows(qlen, lens, page_size=cfg.page_size, k=cfg.pages_per_step)
    assert got.tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("lens,g,budget", [([17, 300, 95], 3, 64), ([16, 1000], 4, 96), ([40, 33], 1, 512)])
def test_cpu_backend_selects_the_torch_backend_pages(mode, lens, g, budget):
    cfg = LocksConfig(budget=budget, **MODES[mode])
    q, k, v, table, seq = paged(lens, 2, g, 32, seed=len(lens) + g)
    store = store_of(k, table, seq, cfg)
    ref, cpu = plan_for("torch", cfg, q, k, table), plan_for("cpu", cfg, q, k, table)
    out_r, lse_r = ref.run(q, k, v, store, table, seq)
    out_c, lse_c = cpu.run(q, k, v, store, table, seq)
    assert torch.equal(cpu.pages, ref.pages)
    assert torch.allclose(out_c, out_r, atol=1e-5) and torch.allclose(lse_c, lse_r, atol=1e-5)


def test_torch_backend_is_the_reference_functions_per_sequence():
    """The spec itself: scores, ranking and pages of the torch backend equal the token-major
    reference functions on each sequence's pages."""
    cfg = LocksConfig(budget=64, rerank=0)
    q, k, v, table, seq = paged([300, 129], 2, 3, 32, seed=4)
    store = store_of(k, table, seq, cfg)
    plan = plan_for("torch", cfg, q, k, table)
    plan.run(q, k, v, store, table, seq)
    for b, n in enumerate(seq.tolist()):
        pc, total = n // S, -(-n // S)
        sc = score_pages_from_summaries(q[b].view(2, 3, 32), store.gather(table[b, :pc]))  # [Hkv, G, Pc]
        ids = select_top_pages(combine_group(sc, cfg.combine), total, cfg.pages_per_step)
        assert torch.equal(plan.pages[b, :, : ids.shape[-1]].long(), ids)


def test_scoring_buffers_score_like_the_store():
    """The cpu backend's two summary sources (a layer's ScoringBuffers, grown page by page like a
    cache's, and a store read through the block table) give the same scores."""
    cfg = LocksConfig(budget=64)
    q, k, v, table, seq = paged([200, 200], 2, 4, 32, seed=6)
    store = store_of(k, table, seq, cfg)
    per_seq = [store.gather(table[b, : 200 // S]) for b in range(2)]  # leading [Hkv] each
    lead = per_seq[0]._map(lambda f, t: torch.stack([t, getattr(per_seq[1], f)]))  # leading [B, Hkv]
    bufs = ScoringBuffers()
    bufs.sync(lead.select_pages(slice(0, 5)))
    bufs.sync(lead)
    a = paged_score(q, bufs, table, seq, combine="mean_share", backend="cpu")
    b = paged_score(q, store, table, seq, combine="mean_share", backend="cpu")
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_run_ranked_with_the_plan_scores_equals_run(mode):
    cfg = LocksConfig(budget=64, **MODES[mode])
    q, k, v, table, seq = paged([400, 130], 2, 3, 32, seed=8)
    store = store_of(k, table, seq, cfg)
    for be in ("torch", "cpu"):
        plan = plan_for(be, cfg, q, k, table)
        out, _ = plan.run(q, k, v, store, table, seq)
        pages = plan.pages.clone()
        scores, _, ranking = paged_score(q, store, table, seq, combine=cfg.combine, backend=be,
                                         centroid=cfg.rerank_scores == "centroid")
        out2, _ = plan.run_ranked(q, k, v, table, seq, ranking, scores=scores)
        assert torch.equal(plan.pages, pages) and torch.equal(out2, out)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_triton_backend_selects_the_torch_backend_pages(mode):
    """The kernels through the interpreter (small sizes), also with summaries numbered apart
    from the K/V pages (``summary_table``)."""
    cfg = LocksConfig(budget=64, **MODES[mode])
    q, k, v, table, seq = paged([300, 100], 2, 4, 64, seed=9)
    store = store_of(k, table, seq, cfg)
    ref, tri = plan_for("torch", cfg, q, k, table), plan_for("triton", cfg, q, k, table)
    out_r, _ = ref.run(q, k, v, store, table, seq)
    out_t, _ = tri.run(q, k, v, store, table, seq)
    assert torch.equal(tri.pages.cpu(), ref.pages.cpu())
    assert torch.allclose(out_t, out_r, atol=1e-4)
    perm = torch.randperm(store.num_pages).to(DEV)  # slot j holds page perm[j]: found through summary_table
    moved = SummaryStore(*(t[perm] for t in store._fields()))
    tri.run(q, k, v, moved, table, seq, summary_table=torch.argsort(perm)[table.long()].to(torch.int32))
    assert torch.equal(tri.pages.cpu(), ref.pages.cpu())


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_short_row_launch_selects_the_same_pages(mode):
    """``KernelOptions.short_row_pages``: rows of at most 8 full pages selected by a launch of their
    own (16 pages a program, the plan's is 32) pick the torch backend's pages, in every mode."""
    from kvlocks.config import KernelOptions

    cfg = LocksConfig(budget=64, **MODES[mode])
    q, k, v, table, seq = paged([300, 100, 150], 2, 4, 64, seed=4)
    store = store_of(k, table, seq, cfg)
    ref = plan_for("torch", cfg, q, k, table)
    tri = plan_for("triton", cfg, q, k, table, options=KernelOptions(short_row_pages=8))
    ws = tri.rerank_ws if cfg.rerank else tri.select_ws
    assert (ws.chunk, ws.short.chunk, ws.short_pages) == (32, 16, 8)
    out_r, _ = ref.run(q, k, v, store, table, seq)
    out_t, _ = tri.run(q, k, v, store, table, seq)
    assert torch.equal(tri.pages.cpu(), ref.pages.cpu())
    assert torch.allclose(out_t, out_r, atol=1e-4)


def _hf_layer(method, cfg, backend, *, b=2, hkv=2, g=2, n=300, d=64, seed=0, kernel_options=None):
    """A one-layer LocksCache holding ``n`` random tokens, and a decode query ``[B, Hq, 1, D]``."""
    from transformers import LlamaConfig

    from kvlocks.integrations.hf import LocksCache

    mc = LlamaConfig(vocab_size=64, hidden_size=hkv * g * d, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=hkv * g, num_key_value_heads=hkv, head_dim=d, max_position_embeddings=4096)
    cache = LocksCache(mc, method=method, config=cfg, backend=backend, kernel_options=kernel_options)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, n, d, generator=gen) + torch.randn(b, hkv, 1, d, generator=gen)
    layer = cache.layers[0]
    layer.update(keys.to(DEV), torch.randn(b, hkv, n, d, generator=gen).to(DEV))
    return cache, layer, (torch.randn(b, hkv * g, 1, d, generator=gen) * 1.5).to(DEV)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("method", ["locks", "oracle"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_hf_cache_selects_the_reference_pages(mode, method, backend):
    """The Hugging Face cache's decode step on the plan (cpu backend; triton through the interpreter)
    selects the pages of the token-major references (choose_pages) and attends them: the locks
    selector runs the whole plan, the oracle its own scores and the plan's select -> attend."""
    from kvlocks.attention.reference import sparse_decode
    from kvlocks.selection.selectors import LayerView, choose_pages

    cfg = LocksConfig(budget=64, **MODES[mode])
    cache, layer, query = _hf_layer(method, cfg, backend, n=300 if backend == "cpu" else 150)  # 150: the interpreter
    out = layer.decode(query, layer.keys, layer.values, None, 0.125)  # [B, 1, Hq, D]
    (plan,) = cache.plans.plans.values()
    assert plan.backend == backend
    q = query[:, :, 0].view(2, 2, 2, 64)
    view = LayerView(keys=layer.keys, summaries=layer.store.summaries, token_mask=None, scale=0.125)
    ref = choose_pages(q, view, cfg, cache.selector)  # [B, Hkv, K]
    assert torch.equal(plan.pages.view(2, 2, -1).long(), ref)
    exp, _ = sparse_decode(q, layer.keys, layer.values, ref, S, scale=0.125)
    torch.testing.assert_close(out[:, 0].reshape(exp.shape), exp, atol=1e-4, rtol=1e-4)
    assert cache.stats.summary()["pages_selected"] == cfg.pages_per_step


@pytest.mark.parametrize("mode", sorted(MODES))
def test_engine_decodes_the_tokens_of_the_hf_cache_in_every_mode(mode):
    """The static-cache engine (its DecodePlan on the torch backend, on CPU) and the Hugging Face
    cache (the plan's cpu backend) decode the same greedy tokens on a small random model at a
    budget that drops pages, for each selection mode."""
    from kvlocks.engine import DecodeEngine, EngineConfig
    from kvlocks.engine.models import model_config, random_model
    from kvlocks.integrations.hf import LocksCache, cache_kwargs, enable

    model = random_model(model_config("llama3.1-8b", num_hidden_layers=2, hidden_size=256, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512),
                         dtype=torch.float32, device="cpu", seed=1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)  # logits far from flat: clear argmaxes
    enable(model)  # the "kvlocks" attention: decode steps of a LocksCache select pages
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(0))
    cfg = LocksConfig(budget=48, **MODES[mode])  # 3 of 10 pages
    cache = LocksCache(model.config, method="locks", config=cfg)
    hf = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        pad_token_id=0, **cache_kwargs(model, cache))[:, ids.shape[1]:]
    eng = DecodeEngine(model, EngineConfig(method="locks", locks=cfg, max_context=176))
    assert eng.backend == "torch"
    assert torch.equal(eng.generate(ids, max_new_tokens=12), hf)
    assert cache.stats.summary()["pages_selected"] == cfg.pages_per_step


def test_hf_cache_kernel_options_reach_its_plans_and_builds(monkeypatch):
    """``LocksCache(kernel_options=...)``: the plans of its decode steps launch with them, and its
    Triton summary builds use their solver."""
    import kvlocks.summary.triton as build_tri
    from kvlocks.config import KernelOptions

    solvers = []
    build = build_tri.build_summaries
    monkeypatch.setattr(build_tri, "build_summaries", lambda *a, **kw: solvers.append(kw.get("solver")) or build(*a, **kw))
    opts = KernelOptions(build_solver="lean", pdl=False)
    cache, layer, query = _hf_layer("locks", LocksConfig(budget=64), "triton", b=1, n=80, kernel_options=opts)
    layer.decode(query, layer.keys, layer.values, None, 0.125)
    (plan,) = cache.plans.plans.values()
    assert plan.options is opts and solvers == ["lean"]
    with pytest.raises(ValueError, match="kernel_options"):
        _hf_layer("locks", LocksConfig(), None, kernel_options={"pdl": False})


def test_sparse_rows_leave_steps_up_to_the_crossover_dense():
    """``dense_below`` counts the step's tokens (every row together), not each row's."""
    qlen = torch.tensor([1, 1, 1, 1])
    lens = torch.tensor([300, 150, 40, 65])  # 555 tokens; pages 19, 10, 3, 5 against k = 4
    assert sparse_rows(qlen, lens, page_size=16, k=4, dense_below=555).tolist() == [False] * 4
    got = sparse_rows(qlen, lens, page_size=16, k=4, dense_below=554)
    assert got.tolist() == [True, True, False, True]  # the row that fits the budget stays dense
    assert sparse_lens(got, lens.to(torch.int32)).tolist() == [300, 150, 0, 65]
    assert sparse_rows(qlen, lens, page_size=16, k=4).tolist() == [True, True, False, True]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_rows_with_no_sparse_length_get_exact_attention(mode, backend):
    """``run(..., sparse_lens=...)``: rows marked 0 are neither scored nor selected (pages -1) and
    equal exact dense attention over their tokens; the other rows keep the pages and outputs of
    the run without ``sparse_lens``."""
    from kvlocks.attention.reference import dense_decode
    from kvlocks.cache.layout import paged_to_token_major

    cfg = LocksConfig(budget=64, **MODES[mode])
    q, k, v, table, seq = paged([300, 100, 200, 30], 2, 4, 64, seed=9)
    store = store_of(k, table, seq, cfg)
    sel = sparse_lens(torch.tensor([True, False, True, False]), seq)  # the plan takes any mix of rows
    assert sel.tolist() == [300, 0, 200, 0]
    whole = plan_for(backend, cfg, q, k, table)
    out_w, _ = whole.run(q, k, v, store, table, seq)
    plan = plan_for(backend, cfg, q, k, table, dense_tokens=160)
    out, lse = plan.run(q, k, v, store, table, seq, sparse_lens=sel)
    for b in (0, 2):
        assert torch.equal(plan.pages[b].cpu(), whole.pages[b].cpu())
        assert torch.allclose(out[b], out_w[b], atol=1e-5)
    for b in (1, 3):
        assert (plan.pages[b] == -1).all()
        n = int(seq[b])
        ref, ref_lse = dense_decode(q[b].view(2, 4, 64).cpu(), paged_to_token_major(k.cpu(), table[b].cpu(), n),
                                    paged_to_token_major(v.cpu(), table[b].cpu(), n))
        assert torch.allclose(out[b].cpu(), ref.reshape(8, 64), atol=1e-5)
        assert torch.allclose(lse[b].cpu(), ref_lse.reshape(8), atol=1e-5)


def test_dense_rows_longer_than_the_launch_is_sized_for_are_attended_whole():
    """The split-KV kernel's dense rows: several programs per row, and a row longer than the
    workspace's ``dense_pages`` still covered whole (fewer programs per page), against exact dense
    attention; a row with a sparse length attends only its page list."""
    from kvlocks.attention.reference import dense_decode, sparse_decode
    from kvlocks.attention.triton import attention_workspace, paged_decode
    from kvlocks.cache.layout import paged_to_token_major

    q, k, v, table, seq = paged([520, 200, 33], 2, 3, 32, seed=4)
    lists = torch.full((3, 2, 3), -1, dtype=torch.int32, device=DEV)
    lists[0, :, :3] = torch.tensor([0, 9, 32], dtype=torch.int32)
    sel = torch.tensor([520, 0, 0], dtype=torch.int32, device=DEV)
    ws = attention_workspace(3, 6, 32, 3, 1, q.dtype, q.device, dense_pages=8)  # rows=1: several programs
    assert ws.dense_splits > 1 and ws.dense_splits * ws.pps < 13  # row 1 (13 pages) exceeds the sizing
    out, lse = paged_decode(q, k, v, table, seq, lists, workspace=ws, sparse_lens=sel)
    for b in range(3):
        n = int(seq[b])
        keys = paged_to_token_major(k.cpu(), table[b].cpu(), n)
        vals = paged_to_token_major(v.cpu(), table[b].cpu(), n)
        if b == 0:
            ref, _ = sparse_decode(q[b].view(2, 3, 32).cpu(), keys, vals, lists[b].long().cpu(), S)
        else:
            ref, _ = dense_decode(q[b].view(2, 3, 32).cpu(), keys, vals)
        assert torch.allclose(out[b].cpu(), ref.reshape(6, 32), atol=1e-5)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_batch_invariant_plan_gives_each_row_the_same_bits_in_any_batch(mode):
    """``KernelOptions(batch_invariant=True)``: a plan for four rows sizes its score and attention
    launches as a plan for one does, so each row's pages, output and log-sum-exp are bitwise those
    of the row decoded alone (LOCKS rows and a dense row, ``sparse_lens`` 0); without it the
    four-row plan splits a dense row's pages otherwise."""
    from kvlocks.config import KernelOptions

    cfg = LocksConfig(budget=64, **MODES[mode])
    q, k, v, table, seq = paged([300, 100, 600, 250], 2, 4, 64, seed=5)
    store = store_of(k, table, seq, cfg)
    sel = sparse_lens(torch.tensor([True, False, True, True]), seq)
    inv = KernelOptions(batch_invariant=True)
    four = plan_for("triton", cfg, q, k, table, options=inv, dense_tokens=1600)
    out4, lse4 = four.run(q, k, v, store, table, seq, sparse_lens=sel)
    pages4 = four.pages.clone()
    for b in range(4):
        one = plan_for("triton", cfg, q[b : b + 1], k, table[b : b + 1], options=inv, dense_tokens=1600)
        assert (one.attend_ws.dense_splits, one.score_ws.ppp) == (four.attend_ws.dense_splits, four.score_ws.ppp)
        out1, lse1 = one.run(q[b : b + 1], k, v, store, table[b : b + 1], seq[b : b + 1], sparse_lens=sel[b : b + 1])
        assert torch.equal(one.pages[0].cpu(), pages4[b].cpu())
        assert torch.equal(out1[0], out4[b]) and torch.equal(lse1[0], lse4[b]), b
    plain4 = plan_for("triton", cfg, q, k, table, dense_tokens=1600)
    plain1 = plan_for("triton", cfg, q[:1], k, table[:1], dense_tokens=1600)
    assert plain4.attend_ws.dense_splits != plain1.attend_ws.dense_splits  # what the option is for


def test_kernel_options_batch_invariant_is_a_boolean():
    from kvlocks.config import KernelOptions

    with pytest.raises(ValueError, match="batch_invariant=1: allowed True or False"):
        KernelOptions(batch_invariant=1)
    assert KernelOptions.from_json(KernelOptions(batch_invariant=True).to_json()).batch_invariant is True
