"""The AMX-packed CPU KV cache layout of vLLM's ``cpu_attn_reshape_and_cache`` (isa ``amx``), read
token-major by :class:`kvlocks.integrations.vllm.compat.PackedTokens`. No vLLM needed: the packed
cache is built here element by element from the layout's offsets, some of which were read off
vLLM 0.32's own op (the real op is exercised in ``tests/vllm/test_locks_backend.py``)."""

import pytest
import torch

from kvlocks.integrations.vllm.compat import PackedTokens, VllmCompatError, split_kv_cache


def key_offset(r, j, bs, d):
    return ((r // 16) * (d // 2) + j // 2) * 32 + (r % 16) * 2 + j % 2


def value_offset(r, j, bs, d):
    return ((j // 16) * (bs // 2) + r // 2) * 32 + (j % 16) * 2 + r % 2


def test_offsets_are_those_vllm_wrote():
    # read off vLLM 0.32.0's cpu_attn_reshape_and_cache, isa 'amx', bfloat16, block 128, D 64
    assert [key_offset(0, j, 128, 64) for j in range(4)] == [0, 1, 32, 33]
    assert key_offset(1, 0, 128, 64) == 2 and key_offset(16, 0, 128, 64) == 1024
    assert key_offset(127, 63, 128, 64) == 8191
    assert [value_offset(0, j, 128, 64) for j in range(3)] == [0, 2, 4]
    assert value_offset(1, 0, 128, 64) == 1 and value_offset(2, 0, 128, 64) == 32
    assert value_offset(0, 63, 128, 64) == 6174 and value_offset(127, 63, 128, 64) == 8191


def packed_cache(keys, values):
    """``keys, values [NB, Hkv, BS, D]`` -> the ``[NB, Hkv, BS, 2D]`` cache in the AMX order."""
    nb, h, bs, d = keys.shape
    kv = torch.zeros(nb, h, 2, bs * d, dtype=keys.dtype)
    for r in range(bs):
        for j in range(d):
            kv[:, :, 0, key_offset(r, j, bs, d)] = keys[:, :, r, j]
            kv[:, :, 1, value_offset(r, j, bs, d)] = values[:, :, r, j]
    return kv.view(nb, h, bs, 2 * d)


@pytest.mark.parametrize("bs,d", [(32, 16), (128, 64), (16, 256)])
def test_packed_tokens_read_every_token_back(bs, d):
    gen = torch.Generator().manual_seed(bs + d)
    nb, h = 3, 2
    keys = torch.randn(nb, h, bs, d, generator=gen).to(torch.bfloat16)
    values = torch.randn(nb, h, bs, d, generator=gen).to(torch.bfloat16)
    k, v = split_kv_cache(packed_cache(keys, values), h, d, "amx")
    assert isinstance(k, PackedTokens) and k.shape == (nb, h, bs, d) and k.dtype == torch.bfloat16
    block = torch.tensor([[0, 2], [1, 1]])  # tensor indices: [..., D]
    head = torch.tensor([[1, 0], [0, 1]])
    row = torch.tensor([[bs - 1, 0], [3, bs // 2 + 1]])
    assert torch.equal(k[block, head, row], keys[block, head, row])
    assert torch.equal(v[block, head, row], values[block, head, row])
    b2, r2 = torch.tensor([2, 0, 1]).unsqueeze(-1), torch.arange(bs).view(1, bs)  # ':' for heads: [3, BS, Hkv, D]
    assert torch.equal(k[b2, :, r2], keys[b2, :, r2]) and k[b2, :, r2].shape == (3, bs, h, d)
    assert torch.equal(v[b2, :, r2], values[b2, :, r2])
    assert torch.equal(k[1, :, 5], keys[1, :, 5]) and torch.equal(v[2, :, bs - 2], values[2, :, bs - 2])


def test_packed_tokens_refuse_shapes_the_packing_cannot_hold():
    with pytest.raises(VllmCompatError, match="multiples of 16"):
        split_kv_cache(torch.zeros(2, 1, 24, 2 * 64, dtype=torch.bfloat16), 1, 64, "amx")
    k, _ = split_kv_cache(torch.zeros(2, 1, 32, 2 * 16, dtype=torch.bfloat16), 1, 16, "amx")
    with pytest.raises(IndexError, match="head index"):
        k[0, 0:1, 0]
