"""The CUDA backend's reading of vLLM 0.24.0's FlashAttention cache, on the CPU with fake objects.

vLLM 0.24 shapes a layer's cache ``(num_blocks, 2, block_size, Hkv, D)`` and reads it with
``kv_cache.unbind(1)``; 0.26 shapes it ``(num_blocks, Hkv, block_size, 2 * D)``
(``docs/results/2026-12-07-cpu-vllm-024-audit``). Checked here: the split views of the 0.24 form in
both memory orders vLLM allocates, one decode step giving the same output over either form, and the
stock backend's declared shape deciding a 2-block cache that fits two forms. The Triton kernels run
in the interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm.compat import VllmCompatError  # noqa: E402
from kvlocks.integrations.vllm.cuda import compat as cuda_compat  # noqa: E402
from kvlocks.integrations.vllm.cuda.step import LocksDecoder, PlanPool  # noqa: E402
from test_vllm_cuda_step import bound_step  # noqa: E402

S, HKV, G, D, NB = 16, 2, 3, 64, 24
CFG = LocksConfig(budget=64, rerank=0)  # k = 4 pages
# 0.24's get_kv_cache_stride_order: logical (NB, 2, BS, Hkv, D) -> memory order
ORDER_024 = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}


@pytest.fixture(autouse=True)
def _fresh_declared_form():
    cuda_compat.declared_kv_form.cache_clear()
    yield
    cuda_compat.declared_kv_form.cache_clear()


def _allocated(shape, order):
    """A cache as vLLM's runners allocate it: contiguous (numbered elements) in the memory order
    ``order``, permuted back to the logical ``shape``."""
    memory = tuple(shape[i] for i in order)
    inv = [order.index(i) for i in range(len(order))]
    return torch.arange(torch.Size(memory).numel(), dtype=torch.float32).view(memory).permute(*inv)


def _forms_of(raw):
    """The same K/V as vLLM 0.26 (``[NB, Hkv, BS, 2D]`` over NHD memory) and 0.24 (NHD) hold them.
    ``raw``: memory ``[NB, BS, Hkv, 2D]`` (keys in the first D, values in the last D)."""
    packed = raw.permute(0, 2, 1, 3)
    blocks_first = torch.stack([raw[..., :D], raw[..., D:]], dim=1)  # [NB, 2, BS, Hkv, D], contiguous
    return packed, blocks_first


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_split_reads_the_024_form_as_its_impl_does(layout):
    shape = (NB, 2, S, HKV, D)
    kv = _allocated(shape, ORDER_024[layout])
    keys, values = cuda_compat.split_flash_kv_cache(kv, HKV, D)
    ref_k, ref_v = kv.unbind(1)  # vLLM 0.24 FlashAttentionImpl.forward / do_kv_cache_update
    assert keys.shape == values.shape == (NB, S, HKV, D) and keys.stride(-1) == 1
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v) and keys.stride() == values.stride()
    if layout == "NHD":  # memory [NB, 2, BS, Hkv, D]: a block's keys, then its values
        assert keys.stride() == (2 * S * HKV * D, HKV * D, D, 1)


def test_kv_forms_by_shape():
    assert cuda_compat.kv_forms((NB, HKV, S, 2 * D), HKV, D) == ["packed"]
    assert cuda_compat.kv_forms((NB, 2, S, HKV, D), HKV, D) == ["blocks_first"]
    assert cuda_compat.kv_forms((2, NB, S, HKV, D), HKV, D) == ["kv_first"]
    assert cuda_compat.kv_forms((2, 2, S, HKV, D), HKV, D) == ["blocks_first", "kv_first"]
    assert cuda_compat.kv_forms((NB, 2, S, HKV + 1, D), HKV, D) == []
    with pytest.raises(VllmCompatError, match="unknown FlashAttention KV cache shape"):
        cuda_compat.split_flash_kv_cache(torch.zeros(NB, 3, S, HKV, D), HKV, D)


def _decode(kv, backend):
    """One uniform decode step of three rows (two LOCKS rows, one that fits the budget) over ``kv``."""
    keys, values = cuda_compat.split_flash_kv_cache(kv, HKV, D)
    blocks = torch.randperm(NB, generator=torch.Generator().manual_seed(1))[: 3 * 8].view(3, 8).to(torch.int32)
    lens = torch.tensor([120, 40, 97], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    dec = LocksDecoder(CFG, num_kv_heads=HKV, group=G, head_dim=D, scale=D ** -0.5, pool=PlanPool(), backend=backend)
    step = bound_step(dec, keys, blocks, lens, qsl)
    query = torch.randn(3, HKV * G, D, generator=torch.Generator().manual_seed(2)) * 2
    output = torch.zeros_like(query)
    dec.run(step, query, keys, values, output, captured=False)
    return output, step.sparse


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_decode_step_reads_the_024_and_026_forms_alike(backend):
    """The same K/V in vLLM 0.24's and 0.26's forms: the store's summaries and the step's output agree
    bitwise (the kernels take the views' strides; only the block stride differs)."""
    raw = torch.randn(NB, S, HKV, 2 * D, generator=torch.Generator().manual_seed(0))
    packed, blocks_first = _forms_of(raw)
    out_026, sparse = _decode(packed, backend)
    out_024, _ = _decode(blocks_first, backend)
    assert sparse.tolist() == [True, False, True]
    assert torch.equal(out_024, out_026) and out_026.abs().sum() > 0


class _FakeFlash:
    """Stands in for vLLM's FlashAttentionBackend: only ``get_kv_cache_shape`` is read."""

    def __init__(self, shape_fn):
        if shape_fn is not None:
            self.get_kv_cache_shape = shape_fn


@pytest.mark.parametrize("declared, dim", [("blocks_first", 1), ("kv_first", 0)])
def test_two_blocks_fit_two_forms_and_the_stock_backend_decides(declared, dim, monkeypatch):
    shapes = {"blocks_first": lambda nb, bs, h, d, cache_dtype_str="auto": (nb, 2, bs, h, d),  # vLLM 0.24
              "kv_first": lambda nb, bs, h, d, cache_dtype_str="auto": (2, nb, bs, h, d)}
    monkeypatch.setattr(cuda_compat, "stock_flash_classes", lambda: (_FakeFlash(shapes[declared]), None, None))
    kv = torch.randn(2, 2, S, HKV, D)
    keys, values = cuda_compat.split_flash_kv_cache(kv, HKV, D)
    ref_k, ref_v = kv.unbind(dim)
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    assert cuda_compat.declared_kv_form(HKV, D) == declared


def test_an_undeclared_or_unknown_form_is_a_compat_error(monkeypatch):
    kv = torch.randn(2, 2, S, HKV, D)
    monkeypatch.setattr(cuda_compat, "stock_flash_classes", lambda: (_FakeFlash(None), None, None))
    with pytest.raises(VllmCompatError, match="cannot tell which"):  # no get_kv_cache_shape to ask
        cuda_compat.split_flash_kv_cache(kv, HKV, D)
    cuda_compat.declared_kv_form.cache_clear()
    odd = _FakeFlash(lambda nb, bs, h, d, cache_dtype_str="auto": (nb, bs, h, 2, d))
    monkeypatch.setattr(cuda_compat, "stock_flash_classes", lambda: (odd, None, None))
    with pytest.raises(VllmCompatError, match="none of the known forms"):
        cuda_compat.split_flash_kv_cache(kv, HKV, D)
    packed = torch.randn(2, HKV, S, 2 * D)  # one form only: the stock backend is not asked
    assert cuda_compat.split_flash_kv_cache(packed, HKV, D)[0].shape == (2, S, HKV, D)
