"""Hybrid models on the Hugging Face path, on tiny random Gemma 3 models (fp32, CPU, seconds).

Sliding-window layers must compute exactly what transformers' own cache and attention compute;
LOCKS acts on the global layers only. The references: transformers' model with its own
``DynamicCache`` and SDPA, naive softmax attention over the last ``sliding_window`` keys, float64
closed forms for the shape-generic references at head_dim 256.
"""

import math

import pytest
import torch

from kvlocks import LocksConfig, build_summaries, dense_decode, score_pages, sparse_decode
from kvlocks.config import method_config
from kvlocks.integrations.hf import LocksCache, enable, method_names
from kvlocks.integrations.hf.decode import prefill, step
from kvlocks.hybrid import layer_windows
from kvlocks.integrations.hf.window import WindowLayer, layer_kinds
from kvlocks.integrations.hf.stats import DecodeStats, layers_line
from kvlocks.scoring import exact_page_lse

from conftest import low_rank_pages

W = 32  # sliding window of the tiny models
TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # global layers 2 and 5
GLOBAL = [2, 5]


def tiny_gemma(*, heads=4, kv_heads=1, seed=0, **extra):
    """A random Gemma 3 text model with the real one's head_dim 256 and layer pattern, scaled down."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=len(TYPES),
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256,
                           sliding_window=W, layer_types=TYPES, max_position_embeddings=1024, **extra)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # q and k norms x2 each: logits of std ~4, peaked attention, so selection matters
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)  # Gemma's RMSNorm scales by 1 + weight
            layer.self_attn.k_norm.weight.fill_(1.0)
    return model


def ids_of(n, seed=1, vocab=128):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, cache, ids, feed):
    """Logits after the prefill of ``ids`` and after each teacher-forced token of ``feed``: [1 + F, V]."""
    out = [prefill(model, cache, ids).float()]
    out += [step(model, cache, int(t)) for t in feed]
    return torch.stack(out)


def transformers_logits(model, ids, feed):
    """The same run on transformers' own cache and SDPA attention (the independent reference)."""
    from transformers.cache_utils import DynamicCache

    model.set_attn_implementation("sdpa")
    try:
        return run(model, DynamicCache(config=model.config), ids, feed)
    finally:
        enable(model)


def close(a, b, rel=1e-4):
    return torch.allclose(a, b, rtol=rel, atol=rel * float(a.abs().max()))


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (2, 2)])  # G = 4 (the real model's) and G = 1
def test_budget_above_context_equals_transformers_own_cache(heads, kv_heads):
    model = tiny_gemma(heads=heads, kv_heads=kv_heads)
    enable(model)
    ids, feed = ids_of(90), ids_of(20, seed=2)[0]  # 90 -> 110 tokens: windows slide, pages fill
    ref = transformers_logits(model, ids, feed)
    big = LocksConfig(budget=1024)
    for method in ("full", "locks", "oracle"):
        got = run(model, LocksCache(model.config, method=method, config=big), ids, feed)
        assert close(ref, got), method
    torch_path = run(model, LocksCache(model.config, method="locks", config=big, backend="torch"), ids, feed)
    assert close(ref, torch_path)


def test_cpu_path_equals_references_at_head_dim_256_small_budget():
    model = tiny_gemma()
    enable(model)
    ids, feed = ids_of(100), ids_of(12, seed=3)[0]
    cfg = LocksConfig(budget=48)  # 3 of 7-8 pages
    fast, ref = (LocksCache(model.config, method="locks", config=cfg, backend=b) for b in (None, "torch"))
    a, b = run(model, fast, ids, feed), run(model, ref, ids, feed)
    assert close(b, a, 1e-5)
    sf, sr = fast.stats.summary(), ref.stats.summary()
    assert sf["layers"] == sr["layers"] == {"window": 4, "sparse": 2}
    assert sf["bytes_read"] == pytest.approx(sr["bytes_read"]) and sf["pages_selected"] == sr["pages_selected"]
    full = run(model, LocksCache(model.config, method="full"), ids, feed)
    assert not close(full, a, 1e-3)  # the global layers really were sparse


def test_layer_kinds_summaries_and_accounting():
    model = tiny_gemma()
    enable(model)
    ids, feed = ids_of(70), ids_of(10, seed=4)[0]
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=32))
    run(model, cache, ids, feed)
    assert layer_windows(model.config) == tuple(W if t == "sliding_attention" else None for t in TYPES)
    assert layer_kinds(cache) == {"window": [0, 1, 3, 4], "sparse": GLOBAL}
    assert [i for i, layer in enumerate(cache.layers) if isinstance(layer, WindowLayer)] == [0, 1, 3, 4]
    # summaries on the global layers only, of every full page
    assert [i for i, layer in enumerate(cache.layers) if getattr(getattr(layer, "store", None), "summaries", None)
            is not None] == GLOBAL
    assert all(cache.layers[i].store.summaries.num_pages == 80 // 16 for i in GLOBAL)
    s = cache.stats.summary()
    assert s["decode_steps"] == 10 and s["layers"] == {"window": 4, "sparse": 2}
    # a window layer reads its window: min(N, W) tokens at the step with N tokens, N = 71 .. 80
    window = s["by_kind"]["window"]
    assert window["tokens_attended"] == W and window["selection_bytes"] == 0
    assert window["kv_bytes"] == window["full_bytes"] == 2 * 1 * W * 256 * 4
    sparse = s["by_kind"]["sparse"]  # sink page + the partial recent page of N - 64 = 7 .. 16 tokens
    assert sparse["tokens_attended"] == pytest.approx(16 + 11.5)
    assert sparse["full_bytes"] == pytest.approx(2 * 256 * 4 * 75.5)
    assert s["tokens_attended"] == pytest.approx((4 * W + 2 * 27.5) / 6)
    assert layers_line(s) == f"layers per step: 2 sparse, 4 window (window layers attend {W} tokens)"
    full = LocksCache(model.config, method="full")
    run(model, full, ids, feed)
    assert full.stats.summary()["layers"] == {"window": 4, "dense": 2}
    assert all(full.layers[i].store.summaries is None for i in GLOBAL)  # full builds no summaries


def test_sliding_layers_read_exactly_their_window_under_a_sparse_method():
    """Every sliding layer's decode step attends exactly the last min(N, W) keys of that layer, with
    exact softmax attention, while the global layers are sparse (probed at the attention call)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from kvlocks.integrations.hf import kvlocks_attention

    calls = []

    def probe(module, query, key, value, attention_mask, **kw):
        out, w = kvlocks_attention(module, query, key, value, attention_mask, **kw)
        calls.append((module.layer_idx, query.clone(), key.clone(), value.clone(), out.clone(), kw["scaling"]))
        return out, w

    AttentionInterface.register("kvlocks_probe", probe)
    AttentionMaskInterface.register("kvlocks_probe", sdpa_mask)
    model = tiny_gemma(seed=5)
    model.set_attn_implementation("kvlocks_probe")
    ids, feed = ids_of(50), ids_of(12, seed=6)[0]
    run(model, LocksCache(model.config, method="locks", config=LocksConfig(budget=32)), ids, feed)
    history = {}  # layer -> every key and value so far [1, Hkv, N, D]
    checked = 0
    for layer, q, k, v, out, scale in calls:
        if q.shape[2] > 1:  # the prefill: all 50 tokens
            history[layer] = (k, v)
            continue
        hk, hv = (torch.cat([h, x[:, :, -1:]], dim=2) for h, x in zip(history[layer], (k, v)))
        history[layer] = (hk, hv)
        if TYPES[layer] != "sliding_attention":
            assert k.shape[2] == hk.shape[2]  # a global layer holds every token
            continue
        n = min(hk.shape[2], W)
        assert torch.equal(k, hk[:, :, -n:]) and torch.equal(v, hv[:, :, -n:])
        g = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
        naive = torch.softmax(q.double() @ kk.transpose(-1, -2) * scale, dim=-1) @ vv  # [1, Hq, 1, D]
        assert torch.allclose(out.double(), naive.transpose(1, 2), atol=1e-5)
        checked += 1
    assert checked == 4 * 12


def test_forks_copy_the_windows():
    model = tiny_gemma(seed=7)
    enable(model)
    ids, feed = ids_of(60), ids_of(6, seed=8)[0]
    base = LocksCache(model.config, method="locks", config=LocksConfig(budget=1024))
    prefill(model, base, ids)
    fork = base.fork(method="full")
    a = torch.stack([step(model, fork, int(t)) for t in feed])
    assert base.layers[0].cumulative_length == 60 and base.layers[0].keys.shape[2] == W - 1  # untouched
    b = run(model, LocksCache(model.config, method="full"), ids, feed)[1:]
    assert close(b, a)


def test_shape_generic_references_at_head_dim_256():
    """Scoring, summaries and attention at D = 256 and G = 1, 3, 4, 8 against float64 closed forms."""
    d = 256
    for g in (1, 3, 4, 8):
        q = torch.randn(2, g, d)
        pages = low_rank_pages((2,), 5, 16, d, rank=8, scale=0.3)  # [2, 5, 16, 256]
        c = LocksConfig(rank=8, basis_bits=16, coef_bits=16)
        logits = torch.einsum("hgd,hpsd->hgps", q.double(), pages.double()) / math.sqrt(d)
        exact = torch.logsumexp(logits, dim=-1)  # [2, G, 5]
        assert torch.allclose(exact_page_lse(q, pages.flatten(1, 2), 16).double(), exact, atol=1e-4)
        assert float((score_pages(q, build_summaries(pages, c), c).double() - exact).abs().max()) < 5e-3
        k, v = pages.flatten(1, 2), torch.randn(2, 80, d)
        out, lse = sparse_decode(q, k, v, torch.arange(5).expand(2, -1), 16)
        w = torch.softmax(torch.einsum("hgd,hnd->hgn", q.double(), k.double()) / math.sqrt(d), dim=-1)
        assert torch.allclose(out.double(), w @ v.double(), atol=1e-5)
        sel = torch.tensor([[0, 2, 4], [1, 3, 4]])
        part, _ = sparse_decode(q, k, v, sel, 16)
        for h in range(2):
            idx = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in sel[h].tolist()])
            ref, _ = dense_decode(q[h : h + 1], k[h : h + 1, idx], v[h : h + 1, idx])
            assert torch.allclose(part[h : h + 1], ref, atol=1e-5)


def test_kernels_take_head_dim_256_and_the_engine_refuses_hybrid_models():
    from kvlocks.engine.parts import model_parts
    from kvlocks.integrations.hf import kernel_path
    from kvlocks.kernels_support import kernel_support
    from kvlocks.selection.selectors import get_selector

    assert kernel_path(get_selector("locks"), LocksConfig(), 256)  # Gemma 3's global layers run the kernels on CUDA
    assert kernel_support(page_size=16, rank=8, head_dim=256) is None
    assert "head_dim=96" in kernel_support(page_size=16, rank=8, head_dim=96)  # other sizes: refused, named
    with pytest.raises(ValueError, match="sliding_attention.*Hugging Face path"):
        model_parts(tiny_gemma())


def test_bad_hybrid_configs_are_refused():
    from transformers import Gemma3TextConfig

    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        LocksCache(Gemma3TextConfig(attn_logit_softcapping=50.0, num_hidden_layers=6), method="locks")
    LocksCache(Gemma3TextConfig(attn_logit_softcapping=50.0, num_hidden_layers=6), method="full")  # dense is fine
    cfg = Gemma3TextConfig(num_hidden_layers=2, layer_types=["full_attention", "full_attention"])
    cfg.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 0: layer type 'chunked_attention'"):
        LocksCache(cfg, method="locks")


def test_decode_stats_kinds_hand_computed():
    s = DecodeStats()
    for _ in range(2):
        s.add(0, kind="window", pages=2, tokens=32, context=100, selection_bytes=0.0, kv_bytes=64.0, full_bytes=64.0)
        s.add(1, kind="sparse", pages=2, tokens=32, context=100, selection_bytes=10.0, kv_bytes=64.0, full_bytes=200.0)
    out = s.summary()
    assert out["decode_steps"] == 2 and out["layers"] == {"window": 1, "sparse": 1}
    assert out["by_kind"]["sparse"] == {"tokens_attended": 32, "selection_bytes": 10.0, "kv_bytes": 64.0,
                                        "bytes_read": 74.0, "full_bytes": 200.0,
                                        "context_tokens": 100.0}
    assert out["read_fraction"] == pytest.approx((64 + 74) / (64 + 200))
    with pytest.raises(ValueError, match="kind='global'"):
        s.add(0, kind="global", pages=1, tokens=1, context=1, selection_bytes=0, kv_bytes=0, full_bytes=0)


def _selector(name, model):
    """A method for LocksCache: the name, or Loki with a calibration on other tokens."""
    if name != "loki":
        return name
    from kvlocks_lab.selectors.loki import LokiSelector, calibrate

    return LokiSelector(calibrate(model, ids_of(96, seed=11)))


@pytest.mark.parametrize("name", [m for m in method_names() if m != "full"])
def test_every_selector_runs_on_the_hybrid_model(name):
    """Budget above the context: transformers' logits; budget 32: finite, different, sliding layers
    still read their window and global layers at most 2 pages (or every key's worth for the oracle)."""
    model = tiny_gemma(seed=9)
    enable(model)
    ids, feed = ids_of(80, seed=10), ids_of(6, seed=12)[0]
    full = run(model, LocksCache(model.config, method="full"), ids, feed)
    big = run(model, LocksCache(model.config, method=_selector(name, model),
                                config=method_config(name, LocksConfig(budget=1024))), ids, feed)
    assert close(full, big), name
    cache = LocksCache(model.config, method=_selector(name, model),
                       config=method_config(name, LocksConfig(budget=32, rank=4)))
    small = run(model, cache, ids, feed)
    assert torch.isfinite(small).all()
    s = cache.stats.summary()
    assert s["layers"] == {"window": 4, "sparse": 2} and s["by_kind"]["window"]["tokens_attended"] == W
    assert s["by_kind"]["sparse"]["tokens_attended"] <= 32 * (4 if name == "oracle_per_head" else 1)  # G heads' pages
