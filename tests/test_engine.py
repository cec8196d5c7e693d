"""The decode engine (kvlocks.engine) on the CPU: torch backend against Hugging Face, the Triton
backend through the interpreter, the benchmark's row code, and (GPU only) CUDA-graph replay."""

import json
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # before any kernel module is imported (as tests/test_kernels.py does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvlocks import LocksConfig  # noqa: E402
from kvlocks.cache.layout import SummaryStore  # noqa: E402
from kvlocks.config import DenseLaunch, KernelOptions  # noqa: E402
from kvlocks.engine import DecodeEngine, EngineConfig, StaticPagedCache, model_parts  # noqa: E402
from kvlocks.engine.models import model_config, random_model  # noqa: E402
from kvlocks.engine.overlap import PrefillBuild  # noqa: E402
from kvlocks.engine.prefill import prefill  # noqa: E402
from kvlocks.plan import paged_build  # noqa: E402

PROMPT = (
    "Alice keeps her bicycle in the red shed behind the library. Bob keeps his canoe in the "
    "boathouse by the river. Carol keeps her telescope on the roof of the observatory. "
    "Where does Alice keep her bicycle?"
)
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "golden", "black", "white"]
THINGS = ["box", "jar", "crate", "basket", "drawer", "bag", "chest", "tin", "bowl", "bottle"]
TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512)
# Engines tune their attention launch at their first step by timing; tests comparing two engines'
# tokens give the tuner one (non-default) launch, so both run the same float sums.
ONE_LAUNCH = (DenseLaunch(8, 8, 2, 2.0),)


def _chat(tok, text):
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(chat, return_tensors="pt", add_special_tokens=False).input_ids


def _long_prompt():
    """About 1.3K tokens of facts, one of which the question asks for."""
    lines = [f"The {c} {t} in room {i * 10 + j} holds {(i * 37 + j * 11) % 97} marbles."
             for i, c in enumerate(COLOURS) for j, t in enumerate(THINGS)]
    return "\n".join(lines) + "\nHow many marbles does the green crate in room 22 hold?"


def _tiny(kind, seed=0, **overrides):
    """A small random model; weights scaled up so its logits are far from flat (clear argmaxes)."""
    m = random_model(model_config(kind, **{**TINY, **overrides}), dtype=torch.float32, device="cpu", seed=seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    return m


def _hf_greedy(model, ids, n):
    from transformers import DynamicCache

    from kvlocks.integrations.hf import cache_kwargs

    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0,
                         **cache_kwargs(model, DynamicCache(config=model.config)))
    return out[:, ids.shape[1]:]


def _same_until_eos(engine_tokens, hf_tokens):
    """HF generate stops at EOS; the engine does not. Compare the tokens HF produced."""
    n = hf_tokens.shape[1]
    return torch.equal(engine_tokens[:, :n], hf_tokens)


# ---- the bundled model, torch backend ----

@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


@pytest.mark.model
def test_engine_equals_full_attention_at_large_budget(model_tok):
    model, tok = model_tok
    ids = _chat(tok, PROMPT)
    hf = _hf_greedy(model, ids, 24)
    for method in ("locks", "dense"):
        eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=1024), max_context=256))
        got = eng.generate(ids, max_new_tokens=24)
        assert _same_until_eos(got, hf), (method, got, hf)
    assert "shed" in tok.decode(hf[0]).lower()


@pytest.fixture(scope="module")
def long_case(model_tok):
    """HF LocksCache path and the engine at budget 256 on one ~1.3K-token prompt."""
    from kvlocks.integrations.hf import LocksCache, cache_kwargs

    model, tok = model_tok
    ids = _chat(tok, _long_prompt())
    cfg = LocksConfig(budget=256)
    cache = LocksCache(model.config, method="locks", config=cfg)
    hf = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, **cache_kwargs(model, cache))
    eng = DecodeEngine(model, EngineConfig(method="locks", locks=cfg, max_context=ids.shape[1] + 32))
    got = eng.generate(ids, max_new_tokens=20)
    return ids, hf[:, ids.shape[1]:], got, eng


@pytest.mark.model
def test_engine_equals_hf_locks_cache_at_budget_256(long_case):
    ids, hf, got, _ = long_case
    assert ids.shape[1] > 1000 and ids.shape[1] > 4 * 256  # selection really drops pages
    assert _same_until_eos(got, hf), (got, hf)


@pytest.mark.model
def test_incremental_builds_equal_a_rebuild(long_case):
    ids, _, got, eng = long_case
    cache, s = eng.cache, eng.cache.page_size
    n = ids.shape[1] + got.shape[1] - 1  # the last generated token is not written
    assert int(cache.seq_lens[0]) == n and n // s > ids.shape[1] // s  # decode filled at least one page
    full = cache.block_table[0, : n // s]
    for layer in (0, len(cache.summaries) - 1):
        fresh = SummaryStore.empty(cache.num_pages, cache.k.shape[-2], cache.k.shape[-1], cache.config)
        paged_build(cache.k[layer], fresh, full, cache.config, backend="torch")
        for a, b in zip(cache.summaries[layer]._fields(), fresh._fields()):
            assert torch.equal(a[full.long()], b[full.long()])


# ---- small random models: GLM (partial interleaved RoPE), batches, the Triton backend ----

@pytest.mark.parametrize("kind", ["glm4-9b-1m", "llama3.1-8b"])
def test_engine_equals_hf_on_random_models_batch_2(kind):
    model = _tiny(kind, seed=1)
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(0))
    hf = _hf_greedy(model, ids, 20)
    for method in ("dense", "locks"):
        eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=1024), batch=2,
                                               max_context=128))
        assert torch.equal(eng.generate(ids, max_new_tokens=20), hf), method



@pytest.mark.parametrize("kind", ["glm4-9b-1m", "llama3.1-8b"])
def test_fused_qkv_projection_keeps_the_model_and_the_tokens(kind):
    """The decode step's q/k/v projection: each layer's q/k/v weights (and GLM's biases) laid out in
    one matrix, the modules' parameters views of it (no memory added); HF's own greedy tokens are
    unchanged after fusing, and the engine's (one product, split, the K/V written inside the
    projection piece) equal them, dense and LOCKS."""
    from kvlocks.engine.fused import fused_qkv

    model = _tiny(kind, seed=1)
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(0))
    hf = _hf_greedy(model, ids, 20)
    params = sum(p.numel() for p in model.parameters())
    for method in ("dense", "locks"):
        eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=1024), batch=2,
                                               max_context=128))
        assert torch.equal(eng.generate(ids, max_new_tokens=20), hf), method
    attn = model.model.layers[0].self_attn
    weight, bias, sizes = fused_qkv(attn)
    assert fused_qkv(attn)[0] is weight  # made once
    assert sizes == (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
    for mod, at in ((attn.q_proj, 0), (attn.k_proj, sizes[0]), (attn.v_proj, sizes[0] + sizes[1])):
        assert mod.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
        assert torch.equal(mod.weight, weight[at : at + mod.out_features])
        assert (mod.bias is not None) == (bias is not None) == (kind == "glm4-9b-1m")
    assert sum(p.numel() for p in model.parameters()) == params
    assert torch.equal(_hf_greedy(model, ids, 20), hf)
    # a parameter replaced (as model.to() does): the stale matrix is not reused
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach() * 2)
    weight2, _, _ = fused_qkv(attn)
    assert weight2 is not weight and torch.equal(weight2[sizes[0]: sizes[0] + sizes[1]], attn.k_proj.weight)


def test_fused_qkv_refuses_layers_it_cannot_fuse():
    from kvlocks.engine.fused import fused_qkv

    attn = _tiny("llama3.1-8b", num_hidden_layers=1).model.layers[0].self_attn
    attn.k_proj = torch.nn.Sequential(attn.k_proj)
    with pytest.raises(ValueError, match="plain torch.nn.Linear"):
        fused_qkv(attn)
    attn = _tiny("llama3.1-8b", num_hidden_layers=1).model.layers[0].self_attn
    attn.v_proj.bias = torch.nn.Parameter(torch.zeros(attn.v_proj.out_features))
    with pytest.raises(ValueError, match="all have a bias or none"):
        fused_qkv(attn)

def test_triton_backend_matches_torch_backend():
    pytest.importorskip("triton")
    model = _tiny("glm4-9b-1m", seed=1, num_hidden_layers=1)
    ids = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(0))
    dev = "cuda" if CUDA else "cpu"
    model = model.to(dev)
    for method in ("dense", "locks"):
        out = {}
        for be in ("torch", "triton"):  # 90 -> 97 tokens: page 5 fills during decode (incremental build)
            eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=48), max_context=112,
                                                   backend=be, cuda_graph=False))
            out[be] = (eng.generate(ids.to(dev), max_new_tokens=8), eng.step.logits.float().cpu())
        assert torch.equal(out["torch"][0], out["triton"][0]), method
        assert torch.allclose(out["torch"][1], out["triton"][1], atol=1e-4 * float(out["torch"][1].abs().max()))


@pytest.mark.skipif(not CUDA, reason="the CUDA score kernel: GPU only")
def test_engine_with_cuda_score_kernel_equals_triton_score_kernel():
    """bf16 model: the engine's tokens and logits with the CUDA score kernel (the default) equal
    those with the Triton packed kernel; everything else (builds, selection, attention) is shared."""
    model = _tiny("glm4-9b-1m", seed=1, num_hidden_layers=2).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(0)).cuda()
    out = {}
    for kernel in ("cuda", "packed"):
        kernels = KernelOptions(score_kernel=kernel, dense_launches=ONE_LAUNCH)
        eng = DecodeEngine(model, EngineConfig(method="locks", locks=LocksConfig(budget=64), max_context=360,
                                               kernels=kernels))
        out[kernel] = (eng.generate(ids, max_new_tokens=24), eng.step.logits.float().cpu())
    assert torch.equal(out["cuda"][0], out["packed"][0])
    assert torch.allclose(out["cuda"][1], out["packed"][1], atol=1e-3 * float(out["packed"][1].abs().max()))


def test_compiled_step_equals_eager_and_compiles_once_for_all_layers():
    """torch.compile of the per-layer pieces: the same tokens and logits as the eager step, and one
    graph per piece serves every layer (parameters, the fused q/k/v weights and each layer's cache
    rows, where the projection piece writes the new K/V, are graph inputs, not constants)."""
    from torch._dynamo.utils import counters

    model = _tiny("glm4-9b-1m", seed=4, num_hidden_layers=3)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        eng = DecodeEngine(model, EngineConfig(method="locks", locks=LocksConfig(budget=32), max_context=64,
                                               backend="torch", compile=compiled))
        out[compiled] = (eng.generate(ids, max_new_tokens=6), eng.step.logits.clone())
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == (2 if compiled else 0), graphs
    assert torch.equal(out[False][0], out[True][0])
    assert torch.allclose(out[False][1], out[True][1], rtol=1e-4, atol=1e-4 * float(out[False][1].abs().max()))


def test_compile_mode_is_max_autotune_on_a_gpu_at_batch_one_only():
    """The pieces' torch.compile mode: max-autotune (step.COMPILE_MODE) on a GPU up to
    KernelOptions.compile_mode_max_batch sequences (default 1: measured faster at batch 1, slower
    at 2-4), the default mode above it and on the CPU (where Inductor would time C++ GEMM templates
    instead); a CPU engine's compiled step records the default."""
    from kvlocks.engine.step import COMPILE_MODE, compile_mode

    limit = KernelOptions().compile_mode_max_batch
    assert COMPILE_MODE == "max-autotune-no-cudagraphs" and limit == 1
    assert compile_mode("cuda", 1, limit) == COMPILE_MODE
    assert compile_mode("cuda", 2, limit) is None and compile_mode("cuda", 4, limit) is None
    assert compile_mode("cpu", 1, limit) is None
    assert compile_mode("cuda", 4, 4) == COMPILE_MODE and compile_mode("cuda", 5, 4) is None
    assert compile_mode("cuda", 1, 0) is None
    model = _tiny("glm4-9b-1m", seed=4, num_hidden_layers=1)
    for limit in (1, 4):
        eng = DecodeEngine(model, EngineConfig(method="dense", max_context=64, backend="torch", compile=True,
                                               kernels=KernelOptions(compile_mode_max_batch=limit)))
        assert eng.step.compile_mode is None


def test_compiled_step_compiles_once_across_cache_sizes():
    """With the K/V writes inside the compiled projection piece the caches are its inputs, their
    row count marked dynamic; engines with ten different cache sizes (more than Dynamo's recompile
    limit of 8, past which a piece runs eagerly) reuse the same two graphs, and each one's tokens
    equal the eager step's."""
    from torch._dynamo.utils import counters

    model = _tiny("llama3.1-8b", seed=5, num_hidden_layers=2)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    counters.clear()
    for pages in range(4, 14):
        cfg = dict(method="dense", max_context=16 * pages, backend="torch")
        eager = DecodeEngine(model, EngineConfig(**cfg)).generate(ids, max_new_tokens=3)
        compiled = DecodeEngine(model, EngineConfig(**cfg, compile=True)).generate(ids, max_new_tokens=3)
        assert torch.equal(eager, compiled), pages
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_incremental_build_runs_only_on_steps_that_fill_a_page(monkeypatch):
    """The step runner tracks the common length on the host and leaves the incremental build out of
    steps that fill no page (one launch per layer saved on 15 of 16 steps): from a 100-token prompt,
    20 steps reach lengths 101..120 and only the step to 112 fills one. Budget 32 < context, so a
    missed build would change the pages chosen; the tokens equal those of steps that all build."""
    from kvlocks.engine import attention

    model = _tiny("llama3.1-8b", seed=2)
    calls = []
    real = attention.paged_build_new
    monkeypatch.setattr(attention, "paged_build_new", lambda *a, **k: (calls.append(int(a[3][0])), real(*a, **k)))
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(0))
    cfg = EngineConfig(method="locks", locks=LocksConfig(budget=32), max_context=128)
    eng = DecodeEngine(model, cfg)
    tokens = eng.generate(ids, max_new_tokens=21)
    assert calls == [112] * model.config.num_hidden_layers
    assert eng.cache.length == 120 and int(eng.cache.seq_lens[0]) == 120
    every = DecodeEngine(model, cfg)  # a build launch on every step: same tokens
    every.prefill(ids)
    every.build_in_flight.finish()
    out = [every.step.tokens.clone()]
    for _ in range(20):
        every.step(build=True)
        out.append(every.step.tokens.clone())
    assert torch.equal(torch.stack(out, dim=1), tokens)
    assert len(calls) == model.config.num_hidden_layers * 21



@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("pdl_on", [False, True])
def test_cuda_graph_replay_equals_eager_steps(pdl_on):
    """Graph replays give the eager steps' tokens across several page fills (budget 64 < context);
    LOCKS replays one of its two graphs per step (with and without the build launches); with and
    without programmatic dependent launch (KernelOptions.pdl)."""
    (launch,) = ONE_LAUNCH
    kernels = KernelOptions(pdl=pdl_on, dense_launches=ONE_LAUNCH)
    model = _tiny("llama3.1-8b", seed=3).to("cuda")
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    for method in ("dense", "locks"):
        engines = [DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=64), batch=2,
                                                    max_context=400, cuda_graph=g, kernels=kernels))
                   for g in (False, True)]
        out = [e.generate(ids, max_new_tokens=40) for e in engines]
        assert torch.equal(out[0], out[1]), method
        # both tuned at their first step (LOCKS: its attention over the selected pages), the graph
        # captured with that launch
        assert [e.step.attn.tuned.launch for e in engines] == [launch, launch], method
        expect = [False, True] if method == "locks" else [False]
        assert sorted(engines[1].runner.graphs) == expect, method


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_compiled_graph_step_with_inductor_pdl_equals_without():
    """KernelOptions.pdl: the compiled pieces with Inductor's programmatic dependent launch, the score
    kernel launched early, and kvlocks.pdl's selection and attention kernels: the graph-replayed bf16
    engine's tokens equal those of the same engine without any of them, dense and LOCKS."""
    model = _tiny("glm4-9b-1m", seed=3, num_hidden_layers=3).to("cuda", torch.bfloat16)  # bf16: the CUDA score kernel
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    for method in ("dense", "locks"):
        out = []
        for on in (False, True):
            torch._dynamo.reset()
            eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=64), batch=2,
                                                   max_context=400, cuda_graph=True, compile=True,
                                                   kernels=KernelOptions(pdl=on, dense_launches=ONE_LAUNCH)))
            out.append(eng.generate(ids, max_new_tokens=24))
        assert torch.equal(out[0], out[1]), method


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_auto_switch_mid_decode_with_cuda_graphs():
    """method="auto" on the GPU: a graph-replayed dense decode switches to LOCKS (bulk build, then
    LOCKS's graph captured) at the threshold; the tokens equal the eager engine's doing the same,
    and at a budget covering the context, the dense engine's."""
    model = _tiny("llama3.1-8b", seed=3).to("cuda")
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    cfg = dict(batch=2, max_context=400, kernels=KernelOptions(dense_launches=ONE_LAUNCH))
    out = {}
    for name, method, budget, graph in (("auto_graph", "auto", 64, True), ("auto_eager", "auto", 64, False),
                                        ("auto_full", "auto", 400, True), ("dense", "dense", 400, True)):
        eng = DecodeEngine(model, EngineConfig(method=method, locks=LocksConfig(budget=budget), cuda_graph=graph,
                                               auto_min_context=320, **cfg))
        out[name] = eng.generate(ids, max_new_tokens=40)
        assert eng.method == ("locks" if method == "auto" else "dense"), name
    assert torch.equal(out["auto_graph"], out["auto_eager"])
    assert torch.equal(out["auto_full"], out["dense"])

# ---- the static cache, random fill, the benchmark rows ----

def test_static_cache_bytes_views_and_random_fill():
    cfg = LocksConfig(budget=64)
    kw = dict(layers=2, batch=3, num_kv_heads=2, head_dim=64, max_context=100, config=cfg, dtype=torch.bfloat16)
    cache = StaticPagedCache(**kw, device="cpu")
    nb = StaticPagedCache.nbytes(**kw)
    assert nb["kv"] == cache.k.numel() * 2 * 2
    assert nb["summaries"] == 2 * cache.num_pages * 2 * cache.summaries[0].bytes_per_page_head()
    assert cache.capacity == 112 and cache.block_table.shape == (3, 7)
    cache.random_fill(40, generator=torch.Generator().manual_seed(0))
    k, _ = cache.token_view(1)
    assert bool((k[:, :40] != 0).all()) and bool((k[:, 40:] == 0).all())
    assert cache.seq_lens.tolist() == [40, 40, 40] and cache.full_page_ids().tolist() == [0, 1, 7, 8, 14, 15]
    cache.build(backend="torch")
    ref = SummaryStore.empty(cache.num_pages, 2, 64, cfg)
    paged_build(cache.k[1], ref, cache.full_page_ids(), cfg, backend="torch")
    assert torch.equal(ref.coef[[7, 8]], cache.summaries[1].coef[[7, 8]])
    with pytest.raises(ValueError, match="random_fill"):
        cache.random_fill(113)


def _prefilled(model, ids, build=None):
    """A prefilled cache; ``build(cache)``: the prefill hook that builds its summaries during it."""
    parts = model_parts(model)
    cache = StaticPagedCache(layers=parts.num_layers, batch=ids.shape[0], num_kv_heads=parts.num_kv_heads,
                             head_dim=parts.head_dim, max_context=ids.shape[1] + 16, config=LocksConfig(budget=32),
                             dtype=parts.dtype, device=parts.device)
    if build is None:
        prefill(parts, cache, ids, chunk=40)
        return cache
    hook = build(cache)
    with hook.prefill_stream():
        prefill(parts, cache, ids, chunk=40, after_layer=hook)
    hook.finish()
    return cache


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_build_during_prefill_equals_build_after_it(backend):
    """The prefill hook (overlapped on a side stream on CUDA, inline on the CPU) builds exactly the
    summaries that a build after the prefill does, for every layer."""
    if backend == "triton":
        pytest.importorskip("triton")
    # both builds run the same solver, whichever it is; on the CPU interpreter lean takes a third of
    # the one-sided solver's time (the solvers: tests/test_kernels.py)
    opts = KernelOptions(build_solver="lean")
    dev = "cuda" if CUDA else "cpu"
    model = _tiny("glm4-9b-1m", seed=2, num_hidden_layers=3).to(dev)
    ids = torch.randint(0, 512, (2, 75), generator=torch.Generator().manual_seed(1)).to(dev)
    after = _prefilled(model, ids)
    after.build(backend=backend, options=opts)
    during = _prefilled(model, ids, lambda c: PrefillBuild(c, ids.shape[1], backend=backend, options=opts))
    full = after.full_page_ids().long()
    assert full.numel() == 2 * 4
    assert torch.equal(after.k, during.k)
    for a, b in zip(after.summaries, during.summaries):
        for x, y in zip(a._fields(), b._fields()):
            assert torch.equal(x[full], y[full])


def test_prefill_build_rejects_missing_layers_and_bad_lengths():
    model = _tiny("llama3.1-8b", num_hidden_layers=2)
    cache = _prefilled(model, torch.zeros(1, 40, dtype=torch.long))
    hook = PrefillBuild(cache, 40, backend="torch")
    hook(0)
    with pytest.raises(RuntimeError, match=r"layers \[1\] were never built"):
        hook.finish()
    with pytest.raises(ValueError, match="n_tokens=999"):
        PrefillBuild(cache, 999)
    with pytest.raises(ValueError, match="layer 5"):
        hook(5)


# ---- bad input ----

def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="EngineConfig.method"):
        EngineConfig(method="sparse")
    with pytest.raises(ValueError, match="basis_bits"):
        EngineConfig(locks=LocksConfig(basis_bits=8))
    with pytest.raises(ValueError, match="EngineConfig.batch"):
        EngineConfig(batch=0)
    with pytest.raises(ValueError, match="EngineConfig.compile"):
        EngineConfig(compile="yes")
    with pytest.raises(ValueError, match=r"EngineConfig.tune_attention='no': allowed True or False"):
        EngineConfig(tune_attention="no")
    with pytest.raises(ValueError, match="model_type"):
        model_parts(torch.nn.Linear(2, 2))
    model = _tiny("llama3.1-8b", num_hidden_layers=1)
    eng = DecodeEngine(model, EngineConfig(max_context=64))
    with pytest.raises(ValueError, match="exceed max_context"):
        eng.generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=10)
    with pytest.raises(ValueError, match="batch"):
        eng.prefill(torch.zeros(2, 10, dtype=torch.long))
    assert EngineConfig.from_json(EngineConfig(method="dense").to_json()) == EngineConfig(method="dense")
    tuned = EngineConfig(kernels=KernelOptions(pdl=False, score_kernel="mma", dense_launches=ONE_LAUNCH))
    assert EngineConfig.from_json(tuned.to_json()) == tuned
    with pytest.raises(ValueError, match="EngineConfig.kernels must be a KernelOptions"):
        EngineConfig(kernels="fast")
    with pytest.raises(ValueError, match=r"EngineConfig.locks: page_size=32: the Triton kernels support page_size=16"):
        EngineConfig(locks=LocksConfig(page_size=32, budget=64), backend="triton")
    with pytest.raises(ValueError, match=r"EngineConfig.locks: head_dim=96: the Triton kernels support head_dim in"):
        DecodeEngine(_tiny("llama3.1-8b", num_hidden_layers=1, head_dim=96), EngineConfig(backend="triton"))
    for kw, needle in ((dict(compile_mode_max_batch=-1), "KernelOptions.compile_mode_max_batch=-1: must be >= 0"),
                       (dict(score_kernel="fast"), "KernelOptions.score_kernel='fast': allowed"),
                       (dict(build_solver="xor"), "KernelOptions.build_solver='xor': allowed"),
                       (dict(dense_launches=()), "KernelOptions.dense_launches=\\(\\): need a non-empty"),
                       (dict(pdl="yes"), "KernelOptions.pdl='yes': allowed True or False")):
        with pytest.raises(ValueError, match=needle):
            KernelOptions(**kw)
    with pytest.raises(ValueError, match=r"DenseLaunch.num_warps=3: allowed \(1, 2, 4, 8, 16\)"):
        DenseLaunch(num_warps=3)


def test_auto_method_picks_dense_below_and_locks_from_its_threshold():
    """method="auto": a generation whose context stays below auto_min_context decodes exactly like
    method="dense", a prompt at least as long exactly like method="locks"."""
    model = _tiny("llama3.1-8b", seed=2)
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(1))
    cfg = dict(locks=LocksConfig(budget=48), max_context=128)
    ref = {m: DecodeEngine(model, EngineConfig(method=m, **cfg)).generate(ids, max_new_tokens=12)
           for m in ("dense", "locks")}
    assert not torch.equal(ref["dense"], ref["locks"])  # the budget is small enough to change tokens
    for threshold, expect in ((111, "dense"), (100, "locks")):  # decode steps run at lengths 100..110
        eng = DecodeEngine(model, EngineConfig(method="auto", auto_min_context=threshold, **cfg))
        assert torch.equal(eng.generate(ids, max_new_tokens=12), ref[expect]), threshold
        assert eng.method == expect
    # one engine, prompts on both sides of the threshold: each prefill picks again
    eng = DecodeEngine(model, EngineConfig(method="auto", auto_min_context=80, **cfg))
    assert torch.equal(eng.generate(ids, max_new_tokens=12), ref["locks"]) and eng.method == "locks"
    short = ids[:, :60]
    dense_short = DecodeEngine(model, EngineConfig(method="dense", **cfg)).generate(short, max_new_tokens=12)
    assert torch.equal(eng.generate(short, max_new_tokens=12), dense_short) and eng.method == "dense"



def test_auto_method_switches_to_locks_when_decode_reaches_its_threshold(monkeypatch):
    """method="auto" with a prompt below auto_min_context: dense decode until the context reaches it,
    then every full page's summaries are built and LOCKS decodes the rest. At a budget covering the
    whole context LOCKS attends every token, so the tokens equal method="dense"'s; the summaries
    equal a rebuild of every full page at the end; the LOCKS step ran exactly from the threshold."""
    model = _tiny("llama3.1-8b", seed=2)
    ids = torch.randint(0, 512, (1, 60), generator=torch.Generator().manual_seed(3))
    cfg = dict(locks=LocksConfig(budget=128), max_context=128)
    dense = DecodeEngine(model, EngineConfig(method="dense", **cfg)).generate(ids, max_new_tokens=40)
    eng = DecodeEngine(model, EngineConfig(method="auto", auto_min_context=80, **cfg))
    seen = []
    for method in ("dense", "locks"):
        eng._use(method)
        run = eng.step.attn.run

        def spy(layer, q, seq_lens, run=run, method=method, **kw):
            if layer == 0:
                seen.append((method, eng.cache.length))
            return run(layer, q, seq_lens, **kw)

        monkeypatch.setattr(eng.step.attn, "run", spy)
    eng._use("dense")
    got = eng.generate(ids, max_new_tokens=40)
    assert torch.equal(got, dense)
    assert eng.method == "locks"
    # step i (0-based) runs at length 60 + i: dense below 80, LOCKS from 80 on
    assert seen == [("dense" if n < 80 else "locks", n) for n in range(60, 99)]
    cache, s = eng.cache, eng.cache.page_size
    full = cache.block_table[0, : int(cache.seq_lens[0]) // s]
    for layer in (0, len(cache.summaries) - 1):
        fresh = SummaryStore.empty(cache.num_pages, cache.k.shape[-2], cache.k.shape[-1], cache.config)
        paged_build(cache.k[layer], fresh, full, cache.config, backend="torch")
        for a, b in zip(cache.summaries[layer]._fields(), fresh._fields()):
            assert torch.equal(a[full.long()], b[full.long()])

def test_auto_threshold_from_the_model_shape():
    """The default auto threshold: the first whole page at which one sequence's K/V per layer reaches
    AUTO_CROSSOVER_KV_BYTES (80 MB): GLM-4-9B (4 KV heads, D = 128, bf16: 2048 B per token) at
    ceil(80e6 / 2048) = 39063 -> 39072 tokens, Llama-3.1-8B (8 KV heads: 4096 B) at 19532 -> 19536;
    an explicit value wins; the engine uses the model's own shape and dtype."""
    from kvlocks.engine.config import AUTO_CROSSOVER_KV_BYTES, auto_min_context_for

    assert AUTO_CROSSOVER_KV_BYTES == 80_000_000
    assert auto_min_context_for(4, 128, 2, 16) == 39072
    assert auto_min_context_for(8, 128, 2, 16) == 19536
    assert auto_min_context_for(8, 128, 4, 16) == 9776  # float32: 8192 B per token, 9766 -> 9776
    with pytest.raises(ValueError, match="head_dim"):
        auto_min_context_for(4, 0, 2, 16)
    model = _tiny("llama3.1-8b", seed=2)  # float32
    c = model.config
    kv_bytes = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    eng = DecodeEngine(model, EngineConfig(method="auto", max_context=64))
    assert eng.auto_min_context == -(-(-(-80_000_000 // kv_bytes)) // 16) * 16
    assert DecodeEngine(model, EngineConfig(method="auto", auto_min_context=80, max_context=64)).auto_min_context == 80
    assert EngineConfig.from_json(EngineConfig(method="auto").to_json()).auto_min_context is None


def test_auto_min_context_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="auto_min_context"):
        EngineConfig(method="auto", auto_min_context=-1)
    with pytest.raises(ValueError, match="method"):
        EngineConfig(method="sometimes")


def test_centroid_candidates_in_the_engine_equal_the_hf_path_and_triton():
    """rerank_scores="centroid" (the locks_centroid mode) on a random GLM shape, 150 tokens (9 full
    pages), budget 48 (k = 3: one free slot), 2 candidates: the engine's decode plan (torch and
    Triton backends) generates the Hugging Face path's tokens (token-major centroid scores and
    re-rank), and other tokens than the same re-rank after Eq. 4 scores."""
    pytest.importorskip("triton")
    from kvlocks.integrations.hf import LocksCache, cache_kwargs, enable

    model = _tiny("glm4-9b-1m", seed=3, num_hidden_layers=2)
    enable(model)
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(4))
    out = {}
    for scores in ("centroid", "summary"):
        cfg = LocksConfig(budget=48, rerank=2, rerank_scores=scores)
        cache = LocksCache(model.config, method="locks", config=cfg)
        hf = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, **cache_kwargs(model, cache))[:, 150:]
        for be in ("torch", "triton") if scores == "centroid" else ("torch",):
            eng = DecodeEngine(model, EngineConfig(method="locks", locks=cfg, max_context=176, backend=be,
                                                   cuda_graph=False))
            out[scores, be] = eng.generate(ids, max_new_tokens=10)
            assert eng.step.attn.plan.config.rerank_scores == scores
            assert torch.equal(out[scores, be], hf), (scores, be)
    assert not torch.equal(out["centroid", "torch"], out["summary", "torch"])
