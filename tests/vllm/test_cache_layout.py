"""vLLM's own CPU cache-write op against the layouts kvlocks reads (run in the vLLM venv)."""

from pathlib import Path

import pytest
import torch

from kvlocks.integrations.vllm import compat


def _has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


CASES = [("vec", torch.float32, "kT_v"), ("vec", torch.bfloat16, "kT_v"),
         pytest.param("amx", torch.bfloat16, "amx",
                      marks=pytest.mark.skipif(not _has_amx(), reason="this CPU has no AMX tiles (amx_bf16)"))]


@pytest.mark.parametrize("isa,dtype,layout", CASES)
@pytest.mark.parametrize("heads,block,dim", [(3, 128, 64), (2, 32, 128), (1, 128, 256)])
def test_tokens_written_by_vllm_read_back_token_major(isa, dtype, layout, heads, block, dim):
    """The probe names the layout, and every slot written by vLLM's op reads back from the split."""
    from vllm import _custom_ops as ops

    compat.probe_cache_layout.cache_clear()
    assert compat.probe_cache_layout(isa, dtype, heads, block, dim) == layout
    gen = torch.Generator().manual_seed(block + dim)
    slots = torch.randperm(4 * block, generator=gen)[:37]
    key = torch.randn(37, heads, dim, generator=gen).to(dtype)
    value = torch.randn(37, heads, dim, generator=gen).to(dtype)
    kv = torch.zeros(4, heads, block, 2 * dim, dtype=dtype)
    k_arg, v_arg = kv.view(4, heads, 2 * block, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_arg, v_arg, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    keys, values = compat.split_kv_cache(kv, heads, dim, layout)
    assert torch.equal(keys[slots // block, :, slots % block], key)
    assert torch.equal(values[slots // block, :, slots % block], value)
