import math

import pytest
import torch

from kvlocks import dense_decode, sparse_decode


def naive_attention(q, k, v, scale):
    """Per-head loop with softmax written out: q [G, D], k/v [T, D]."""
    logits = (q.double() @ k.double().T) * scale
    lse = torch.logsumexp(logits, dim=-1)
    return torch.softmax(logits, dim=-1) @ v.double(), lse


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000])
def test_all_pages_equals_dense_attention(n):
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, n, 32), torch.randn(3, n, 32)
    pages = torch.arange(-(-n // 16)).expand(3, -1)
    out, lse = sparse_decode(q, k, v, pages, 16)
    for h in range(3):
        ref, ref_lse = naive_attention(q[h], k[h], v[h], 1 / math.sqrt(32))
        assert torch.allclose(out[h].double(), ref, atol=1e-5)
        assert torch.allclose(lse[h].double(), ref_lse, atol=1e-5)
    dout, dlse = dense_decode(q, k, v)
    assert torch.allclose(dout, out, atol=1e-6) and torch.allclose(dlse, lse, atol=1e-6)


def test_selected_pages_only_and_partial_page_masked():
    n, s = 5 * 16 + 3, 16
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    pages = torch.tensor([[0, 2, 5], [1, 3, 5]])
    out, lse = sparse_decode(q, k, v, pages, s)
    for h in range(2):
        idx = torch.cat([torch.arange(p * s, min((p + 1) * s, n)) for p in pages[h].tolist()])
        ref, ref_lse = naive_attention(q[h], k[h, idx], v[h, idx], 0.25)
        assert torch.allclose(out[h].double(), ref, atol=1e-5)
        assert torch.allclose(lse[h].double(), ref_lse, atol=1e-5)


def test_output_error_identity_eq1():
    """o - o_S = eps (v_bar_Sc - v_bar_S), eps = 1 - gamma_S (Eq. 1), checked numerically."""
    n = 64
    q, k, v = torch.randn(1, 1, 16), torch.randn(1, n, 16), torch.randn(1, n, 16)
    o, lse = dense_decode(q, k, v)
    sel = torch.tensor([[0, 2]])
    o_s, lse_s = sparse_decode(q, k, v, sel, 16)
    rest = torch.tensor([[1, 3]])
    o_c, _ = sparse_decode(q, k, v, rest, 16)
    gamma = torch.exp(lse_s - lse)
    assert torch.allclose(o - o_s, (1 - gamma)[..., None] * (o_c - o_s), atol=1e-5)


def test_token_mask_excludes_padding():
    q, k, v = torch.randn(1, 2, 16), torch.randn(1, 40, 16), torch.randn(1, 40, 16)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[0, :7] = False
    out, _ = sparse_decode(q, k, v, torch.tensor([[0, 1, 2]]), 16, token_mask=mask)
    ref, _ = dense_decode(q, k[:, 7:], v[:, 7:])
    assert torch.allclose(out, ref, atol=1e-6)


def test_bad_inputs():
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 40, 16), torch.randn(2, 40, 16)
    with pytest.raises(ValueError, match="empty context"):
        sparse_decode(q, k[:, :0], v[:, :0], torch.zeros(2, 0, dtype=torch.long), 16)
    with pytest.raises(ValueError, match="page_ids must lie"):
        sparse_decode(q, k, v, torch.tensor([[0, 3], [0, 1]]), 16)
    with pytest.raises(ValueError, match="head_dim"):
        sparse_decode(torch.randn(2, 3, 8), k, v, torch.tensor([[0], [0]]), 16)
    with pytest.raises(ValueError, match="keys/values shape"):
        dense_decode(q, k, v[:, :30])
