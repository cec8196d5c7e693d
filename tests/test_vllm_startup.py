"""The vLLM plugin's start-up rules without vLLM: what KVLOCKS_VLLM_CONFIG may hold, which engine
settings are refused, the per-layer decisions and their table, strict mode, the memory arithmetic
and the exact sink correction."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (the CUDA step's are)

from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm import layers as lt  # noqa: E402
from kvlocks.integrations.vllm import settings, startup  # noqa: E402
from kvlocks.integrations.vllm.cuda import memory  # noqa: E402
from kvlocks.integrations.vllm.sinks import apply_sinks  # noqa: E402

CFG = LocksConfig(budget=256)


@pytest.mark.parametrize("text, match", [
    ("{budget: 2048}", "not valid JSON"),
    ("[2048]", "must be a JSON object"),
    ('{"budget": 2048, "bogus": 1}', "unknown fields"),
    ('{"budget": 16}', "budget=16"),                      # one page: under the two pages required
    ('{"budget": 2050}', "multiple of page_size"),
    ('{"budget": 2048, "strict": "yes"}', "allowed true or false"),
    ('{"budget": 2048, "dense_below": -1}', r"dense_below.*\"auto\" or an integer >= 0"),
    ('{"budget": 2048, "dense_below": "short"}', r"dense_below.*\"auto\" or an integer >= 0"),
])
def test_malformed_config_is_refused_naming_the_variable(text, match):
    with pytest.raises(ValueError, match=match) as err:
        settings.parse(text)
    assert "KVLOCKS_VLLM_CONFIG" in str(err.value)


def test_config_round_trip_with_and_without_strict():
    config, plug = settings.parse(CFG.to_json())
    assert config == CFG and plug.strict is False
    text = settings.to_text(CFG, settings.PluginSettings(strict=True))
    assert settings.parse(text) == (CFG, settings.PluginSettings(strict=True))
    assert "strict" not in settings.to_text(CFG, settings.PluginSettings())
    text = settings.to_text(CFG, settings.PluginSettings(dense_below=0))
    assert settings.parse(text) == (CFG, settings.PluginSettings(dense_below=0))
    assert "dense_below" not in settings.to_text(CFG, settings.PluginSettings())


def test_enable_passes_kernel_options_to_the_engine_processes(monkeypatch):
    """``enable(kernels=...)`` writes them into ``$KVLOCKS_VLLM_CONFIG``, which the engine's processes
    read back (the plans' KernelOptions); a wrong type is refused."""
    from kvlocks.config import KernelOptions
    from kvlocks.integrations.vllm import enable, plugin

    monkeypatch.delenv(settings.ENV_VAR, raising=False)
    monkeypatch.setattr(plugin, "register", lambda: None)
    enable(CFG, dense_below=0, kernels=KernelOptions(short_row_pages=5120, pdl=False))
    config, plug = settings.current()
    assert config == CFG and plug.dense_below == 0
    assert plug.kernels == KernelOptions(short_row_pages=5120, pdl=False)
    with pytest.raises(ValueError, match='"kernels"=.*allowed an object of KernelOptions fields'):
        enable(CFG, kernels="short")


def test_vllm_batch_invariant_mode_makes_the_plans_batch_invariant(monkeypatch):
    """``VLLM_BATCH_INVARIANT=1`` turns on ``KernelOptions.batch_invariant`` in the CUDA backend's
    plans, keeping the other kernel options of ``$KVLOCKS_VLLM_CONFIG``; a value vLLM cannot read
    either is refused, naming it."""
    from kvlocks.config import KernelOptions
    from kvlocks.integrations.vllm.cuda.step import PlanPool

    monkeypatch.setenv(settings.ENV_VAR, settings.to_text(CFG, settings.PluginSettings(kernels=KernelOptions(pdl=False))))
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert PlanPool().options == KernelOptions(pdl=False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert PlanPool().options == KernelOptions(pdl=False, batch_invariant=True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert PlanPool().options.batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT='yes': allowed an integer"):
        PlanPool().options


def test_dense_below_resolves_by_platform_and_head_shape():
    """An integer is kept on both platforms; "auto" is 0 on CPU and, on CUDA, the crossover of the
    head shape's K/V width: 2 x 128 (GLM-4-9B) 12K tokens, 4 x 128 and 8 x 128 (Llama-3.1-8B) 10K."""
    r = settings.resolve_dense_below
    assert r(4096, cuda=True, num_kv_heads=8, head_dim=128) == r(4096, cuda=False, num_kv_heads=8, head_dim=128) == 4096
    assert r("auto", cuda=False, num_kv_heads=2, head_dim=128) == 0
    assert r("auto", cuda=True, num_kv_heads=2, head_dim=128) == 12288
    assert r("auto", cuda=True, num_kv_heads=1, head_dim=256) == 12288
    assert r("auto", cuda=True, num_kv_heads=4, head_dim=128) == 10240
    assert r("auto", cuda=True, num_kv_heads=8, head_dim=128) == 10240
    assert settings.PluginSettings().dense_below == "auto"


@pytest.mark.parametrize("kw, match", [
    (dict(platform="cuda", dtype=torch.float32), r"dtype=float32.*\['bfloat16', 'float16'\]"),
    (dict(platform="cuda", kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8'.*\['auto', 'bfloat16', 'float16'\]"),
    (dict(platform="cuda", kv_cache_dtype="fp8_e4m3"), "kv_cache_dtype='fp8_e4m3'"),
    (dict(platform="cuda", kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype='fp8_e5m2'"),
    (dict(platform="cuda", block_size=8), "block_size=8: must be a multiple of 16"),
    (dict(platform="cuda", block_size=24), "block_size=24"),
    (dict(platform="cpu", block_size=16), "block_size=16: must be a multiple of 32"),
])
def test_engine_settings_lockS_cannot_run_are_refused(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        startup.check(CFG, **kw)
    assert "KVLOCKS_VLLM_CONFIG" in str(err.value)


@pytest.mark.parametrize("kw", [
    dict(platform="cuda", dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16),
    dict(platform="cuda", dtype=torch.float16, kv_cache_dtype="float16", block_size=64),
    dict(platform="cuda", dtype=None, kv_cache_dtype=None, block_size=None),
    dict(platform="cpu", dtype=torch.float32, kv_cache_dtype="auto", block_size=128),
])
def test_engine_settings_lockS_runs_pass(kw):
    assert startup.refusal(CFG, **kw) is None


def _decide(**facts):
    return lt.decide(lt.LayerFacts(**{"attn_type": "decoder", **facts}), head_dims=(64, 128), sinks_supported=True,
                     dense="FlashAttention")


def test_layer_decisions_name_the_reason():
    import enum

    class AttentionType(str, enum.Enum):  # as vLLM 0.26 / 0.32 declare it
        DECODER = "decoder"

    assert _decide(attn_type=AttentionType.DECODER) == lt.Decision(lt.LOCKS, "")
    assert _decide() == lt.Decision(lt.LOCKS, "")
    assert _decide(sinks=True) == lt.Decision(lt.LOCKS, "with learned sinks")
    window = _decide(sliding_window=512, sinks=True)
    assert window.outcome == lt.BY_DESIGN and "sliding window 512" in window.reason
    assert _decide(soft_cap=30.0).outcome == lt.FALLBACK and "soft-cap 30.0" in _decide(soft_cap=30.0).reason
    assert "ALiBi" in _decide(alibi=True).reason
    assert "head_size 256" in _decide(head_size=256).reason and _decide(head_size=256).outcome == lt.FALLBACK
    assert "cross-attention" in _decide(attn_type="encoder_decoder").reason
    assert _decide(attn_type="encoder_only").outcome == lt.BY_DESIGN
    assert "model.layers.3" in _decide(kv_shared_with="model.layers.3.attn").reason
    cpu = lt.decide(lt.LayerFacts(attn_type="decoder", head_size=96), head_dims=range(2, 4097, 2),
                    sinks_supported=False, dense="CPU attention")
    assert cpu.outcome == lt.LOCKS


def _gemma_like() -> dict:
    """18 layers: 5 sliding then 1 global, repeated; head_dim 256 (LOCKS kernels at 64/128 here)."""
    out = {}
    for i in range(18):
        glob = i % 6 == 5
        out[f"model.layers.{i}.self_attn.attn"] = _decide(sliding_window=None if glob else 512, head_size=256)
    return out


def test_one_table_and_strict_mode():
    decisions = _gemma_like()
    text = lt.table(decisions)
    assert text.splitlines()[0].endswith("18): 0 LOCKS, 15 by design, 3 fallback")
    assert "layers 0-4, 6-10, 12-16: FlashAttention: sliding window 512" in text
    assert "layers 5, 11, 17: FlashAttention: head_size 256" in text
    err = lt.strict_error(decisions)
    assert "3 attention layer(s)" in err and "layers 5, 11, 17: FlashAttention: head_size 256" in err
    with pytest.raises(ValueError, match="strict"):
        lt.report(decisions, strict=True)
    assert lt.report(decisions, strict=False, key="k1") and not lt.report(decisions, strict=False, key="k1")
    windows_only = {n: d for n, d in decisions.items() if d.outcome == lt.BY_DESIGN}
    assert lt.strict_error(windows_only) is None  # sliding windows are not fallbacks


def test_a_group_with_a_fallback_layer_demotes_its_lockS_layers():
    decisions = {"model.layers.0.attn": _decide(), "model.layers.1.attn": _decide(soft_cap=50.0),
                 "model.layers.2.attn": _decide()}
    demoted = lt.demote(decisions, list(decisions), "FlashAttention")
    assert demoted == ["model.layers.0.attn", "model.layers.2.attn"]
    assert all(d.outcome == lt.FALLBACK for d in decisions.values())
    assert "holds layer 1" in decisions["model.layers.0.attn"].reason


def test_summary_bytes_by_hand():
    # S 16, R 8, D 128: basis 128*8/2 = 512, coefficients 16*8 = 128, centroid 128 -> 768 payload;
    # scales 2*8 + 2*17 = 50 -> 818 per (page, KV head); Hkv 8 -> 6544 + 12 tag bytes
    assert memory.summary_bytes_per_block(CFG, 8, 128) == 8 * 818 + 12
    # D 64: 256 + 128 + 64 + 50 = 498 per (page, head); Hkv 3 -> 1494 + 12
    assert memory.summary_bytes_per_block(CFG, 3, 64) == 3 * 498 + 12
    assert memory.kv_bytes_per_block(16, 8, 128, 2) == 65536  # bf16 K+V of one 16-token block
    from kvlocks.cache.layout import SummaryStore  # the store's own count per (page, head) agrees

    assert SummaryStore.empty(5, 3, 64, CFG, device="cpu").bytes_per_page_head() == 498


def test_reserve_and_pool_arithmetic_by_hand():
    # Llama-3.1-8B shape: 32 layers, Hkv 8, D 128, bf16, every layer LOCKS
    mb = memory.model_bytes(CFG, [(True, 8, 128, 2)] * 32, hybrid=False)
    assert mb.kv_per_block == 32 * 65536 and mb.summary_per_block == 32 * 6556
    assert math.isclose(mb.rho, 6556 / 65536)
    free = 60 * 2**30
    r = memory.reserve_bytes(mb.rho, free)
    pool = free - r  # what vLLM sizes its pool from
    blocks = pool // mb.kv_per_block
    assert blocks * mb.summary_per_block <= r  # the summaries of that pool fit the reserve
    assert r - blocks * mb.summary_per_block < mb.kv_per_block  # and the reserve is not larger than needed
    have, without = memory.pool_tokens(blocks, 16, mb, r)
    assert have == blocks * 16 and without == (blocks + r // mb.kv_per_block) * 16
    # Gemma 3 270M shape (hybrid): 3 global LOCKS layers share K/V tensors with the window groups
    gm = memory.model_bytes(CFG, [(i % 6 == 5, 1, 256, 2) for i in range(18)], hybrid=True)
    assert gm.kv_per_block == 3 * memory.kv_bytes_per_block(16, 1, 256, 2)
    assert gm.summary_per_block == 3 * memory.summary_bytes_per_block(CFG, 1, 256)
    assert memory.reserve_bytes(0.0, free) == 0 and memory.reserve_bytes(0.1, -5) == 0


@pytest.mark.parametrize("n", [1, 17, 300])
def test_sink_correction_equals_dense_attention_with_a_sink(n):
    """softmax over [logits, sink] (the sink has no value) == attention without it * sigmoid(lse - sink)."""
    g = torch.Generator().manual_seed(n)
    hq, d = 6, 64
    q, k, v = (torch.randn(hq, d, generator=g), torch.randn(hq, n, d, generator=g), torch.randn(hq, n, d, generator=g))
    sinks = torch.randn(hq, generator=g) * 3
    logits = torch.einsum("hd,hnd->hn", q, k) / math.sqrt(d)
    p = torch.softmax(torch.cat([logits, sinks[:, None]], dim=-1), dim=-1)[:, :n]
    want = torch.einsum("hn,hnd->hd", p, v)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hn,hnd->hd", torch.softmax(logits, dim=-1), v)
    got = apply_sinks(out[None].clone(), lse[None], sinks)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
