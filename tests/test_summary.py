import math

import pytest
import torch

from kvlocks import LocksConfig, build_summaries
from kvlocks.summary.build import spectral_basis
from kvlocks.summary.quant import pack_bits, quantize, unpack_bits

from conftest import low_rank_pages


def test_payload_is_768_bytes_at_d128_s16_r8():
    s = build_summaries(torch.randn(2, 3, 16, 128), LocksConfig())
    assert s.bytes_per_page() == (512 + 128 + 128, 2 * (8 + 16 + 1))
    # 9.4% of a bf16 K/V page (2 * 16 * 128 * 2 bytes), as the paper states
    assert abs(768 / (2 * 16 * 128 * 2) - 0.094) < 0.001
    assert s.basis.dtype == torch.uint8 and s.basis.shape == (2, 3, 8, 64)  # two int4 per byte


def test_unquantized_payload_counts_float16():
    s = build_summaries(torch.randn(1, 2, 16, 64), LocksConfig(basis_bits=16, coef_bits=16))
    assert s.bytes_per_page() == (64 * 8 * 2 + 16 * 8 * 2 + 64 * 2, 0)


def test_basis_is_orthonormal_and_reconstructs_low_rank_pages_exactly():
    keys = low_rank_pages((3,), 5, 16, 64, rank=6).double()
    mu, basis, coef, tau, sigma = spectral_basis(keys, rank=8)
    eye = basis[..., :6, :] @ basis[..., :6, :].transpose(-1, -2)
    assert torch.allclose(eye, torch.eye(6).expand_as(eye).float(), atol=1e-5)
    recon = mu.unsqueeze(-2) + coef @ basis
    assert torch.allclose(recon, keys.float(), atol=1e-4 * keys.abs().max().item())
    assert float(tau.max()) < 1e-6 * float((sigma[..., 0] ** 2).max())


def test_tail_equals_discarded_energy():
    keys = torch.randn(4, 16, 32)
    mu, basis, coef, tau, _ = spectral_basis(keys, rank=5)
    dev = keys - keys.mean(dim=-2, keepdim=True)
    resid = dev - coef @ basis
    assert torch.allclose(tau, (resid**2).sum(dim=(-1, -2)), rtol=1e-4, atol=1e-4)
    # and equals the sum of the squared singular values past rank 5
    sv = torch.linalg.svdvals(dev.double())
    assert torch.allclose(tau.double(), (sv[:, 5:] ** 2).sum(-1), rtol=1e-4)


def test_sliced_eigensolve_equals_one_batch():
    """The reference solves the pages' Gram matrices in slices (bounded GPU workspace): the same
    eigendecompositions as one batched call, including a last slice shorter than the others."""
    from kvlocks.summary import build

    keys = torch.randn(3, 7, 16, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    dev = keys - keys.mean(dim=-2, keepdim=True)
    gram = dev @ dev.transpose(-1, -2)  # [3, 7, 16, 16]
    assert gram[..., 0, 0].numel() <= build.EIGH_SLICE  # one call by default
    whole = build._eigh(gram)
    sliced = build._eigh(gram, slice_pages=4)  # 21 pages: slices of 4, last of 1
    for a, b in zip(whole, sliced):
        assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("case", ["constant", "repeated", "rank1", "zeros"])
def test_degenerate_pages_give_finite_summaries(case):
    k = torch.randn(1, 16, 64)
    if case == "constant":
        k = k[:, :1].expand(1, 16, 64).clone()
    elif case == "repeated":
        k = torch.cat([k[:, :1]] * 8 + [k[:, 1:2]] * 8, dim=1)
    elif case == "rank1":
        k = k[:, :1] + torch.randn(1, 16, 1) * k[:, 1:2]
    else:
        k = torch.zeros(1, 16, 64)
    for bits in (2, 4, 8, 16):
        s = build_summaries(k, LocksConfig(basis_bits=bits))
        for t in (s.basis_float(), s.coef_float(), s.centroid_float(), s.tau):
            assert torch.isfinite(t).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantization_error_within_half_a_step(bits):
    x = torch.randn(7, 5, 64) * torch.logspace(-3, 3, 5)[None, :, None]
    q, scale = quantize(x, bits, dim=-1)
    qm = 2 ** (bits - 1) - 1
    assert int(q.abs().max()) <= qm
    assert scale.dtype == torch.float16
    err = (x - q.float() * scale.float()[..., None]).abs()
    assert bool((err <= scale.float()[..., None] / 2 * (1 + 1e-6) + 1e-12).all())
    # the scale is the smallest float16 >= max|x| / qmax
    assert bool((scale.float() >= x.abs().amax(-1) / qm).all())
    # ... at most one float16 step above it (relative 2^-10 for normals, 2^-24 for subnormals)
    exact = x.abs().amax(-1) / qm
    assert bool((scale.float() <= torch.maximum(exact * (1 + 2**-9), exact + 2**-24)).all())


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    qm = 2 ** (bits - 1)
    q = torch.randint(-qm, qm, (3, 4, 64), dtype=torch.int8)
    p = pack_bits(q, bits)
    assert p.dtype == torch.uint8 and p.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_bits(p, bits), q)


def test_int4_int8_summary_round_trip_within_analytic_bounds():
    keys = torch.randn(2, 6, 16, 128) * 3
    c = LocksConfig(basis_bits=4, coef_bits=8)
    s = build_summaries(keys, c)
    mu, basis, coef, _, _ = spectral_basis(keys, c.rank)
    assert bool(((s.basis_float() - basis).abs() <= s.basis_scale.float()[..., None] / 2 + 1e-7).all())
    assert bool(((s.coef_float() - coef).abs() <= s.coef_scale.float()[..., None] / 2 + 1e-6).all())
    assert bool(((s.centroid_float() - mu).abs() <= s.centroid_scale.float()[..., None] / 2 + 1e-6).all())


def test_bad_inputs_raise():
    c = LocksConfig()
    with pytest.raises(ValueError, match="full pages"):
        build_summaries(torch.randn(2, 3, 15, 64), c)
    bad = torch.randn(1, 2, 16, 64)
    bad[0, 1, 3, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        build_summaries(bad, c)
    bad[0, 1, 3, 7] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        build_summaries(bad, c)
    with pytest.raises(ValueError, match="torch.Tensor"):
        build_summaries([[1.0]], c)
    empty = build_summaries(torch.randn(2, 0, 16, 64), c)
    assert empty.num_pages == 0


def test_incremental_append_equals_batch_build():
    keys = torch.randn(2, 5, 16, 64)
    c = LocksConfig()
    whole = build_summaries(keys, c)
    parts = build_summaries(keys[:, :3], c).cat(build_summaries(keys[:, 3:], c))
    assert torch.equal(whole.coef, parts.coef) and torch.equal(whole.basis, parts.basis)
    assert math.isclose(float(whole.tau.sum()), float(parts.tau.sum()), rel_tol=1e-6)
