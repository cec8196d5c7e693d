"""Dense attention left to SDPA: cuDNN's backend is switched off on CUDA only, and only for the call."""

from types import SimpleNamespace

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_mod

from kvlocks.integrations.hf.sdpa import dense_attention


def _flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(),
            "efficient": b.mem_efficient_sdp_enabled(), "math": b.math_sdp_enabled()}


@pytest.fixture
def spy(monkeypatch):
    seen = []

    def fake(module, query, key, value, attention_mask, **kwargs):
        seen.append(_flags())
        return "out", None

    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", fake)
    return seen


def test_cuda_queries_run_without_cudnn_and_the_flags_come_back(spy):
    before = _flags()
    assert before["cudnn"], "PyTorch enables cuDNN attention by default"
    out = dense_attention(None, SimpleNamespace(is_cuda=True), None, None, None, scaling=0.1)
    assert out == ("out", None)
    assert spy == [{"cudnn": False, "flash": True, "efficient": True, "math": True}]
    assert _flags() == before


def test_cpu_queries_keep_every_backend(spy):
    before = _flags()
    dense_attention(None, torch.zeros(1, 1, 1, 4), None, None, None)
    assert spy == [before]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_result_equals_exact_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, device="cuda", dtype=torch.bfloat16) for n in (1, 300, 300))
    module = SimpleNamespace(is_causal=False, num_key_value_groups=1)
    out, _ = dense_attention(module, q, k, v, None, scaling=0.125)
    p = torch.softmax((q.float() @ k.float().transpose(-1, -2)) * 0.125, dim=-1)
    ref = (p @ v.float()).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
