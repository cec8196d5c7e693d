"""Algorithm 1: build LOCKS page summaries (pure PyTorch reference, any device).

For each full page of S post-RoPE keys: centroid mu, centred deviations D (S x D), the small
S x S Gram matrix D D^T, its eigendecomposition, the top-R orthonormal basis V = D^T U_R / Sigma_R,
coefficients C = D V (the projection of each deviation on the basis) and the spectral tail tau.
Then quantization: basis int4 (per-column scales), coefficients int8 (per-row scales), centroid
int8 (one scale).
"""

from __future__ import annotations

import torch

from kvlocks._checks import check_finite, check_tensor
from kvlocks.config import LocksConfig
from kvlocks.summary.quant import pack_bits, quantize, to_fp16_checked
from kvlocks.summary.types import PageSummaries

# A retained direction whose singular value is below this fraction of the page's largest one is
# treated as numerically zero: its basis vector and coefficients are set to 0 and its energy is
# added to tau. In float64 the Gram eigenvalues are accurate to ~1e-16 * lambda_1, so sigma is
# trustworthy down to ~1e-8 * sigma_1; 1e-6 keeps a wide margin and never produces NaN.
_REL_SIGMA_FLOOR = 1e-6
# Pages per batched eigensolve. On a GPU, cuSOLVER's batched solver sizes its workspace by the whole
# batch: one call on 2 x 16,387 pages asked for 19 GiB on the H200. Slices bound the workspace; each
# matrix's decomposition is independent of the others in its batch.
EIGH_SLICE = 4096


def _eigh(gram: torch.Tensor, slice_pages: int = EIGH_SLICE) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.eigh`` of a batch of small symmetric matrices, ``slice_pages`` at a time."""
    if gram[..., 0, 0].numel() <= slice_pages:
        return torch.linalg.eigh(gram)
    flat = gram.reshape(-1, *gram.shape[-2:])
    parts = [torch.linalg.eigh(flat[i : i + slice_pages]) for i in range(0, flat.shape[0], slice_pages)]
    evals = torch.cat([p[0] for p in parts]).reshape(gram.shape[:-1])
    evecs = torch.cat([p[1] for p in parts]).reshape(gram.shape)
    return evals, evecs


def spectral_basis(keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
    """Unquantized page-local spectral decomposition.

    Parameters
    ----------
    keys : float tensor ``[..., P, S, D]``
        Full pages of post-RoPE keys.
    rank : int
        R, at most S.

    Returns
    -------
    mu : float32 ``[..., P, D]``
    basis : float32 ``[..., P, R, D]``, orthonormal rows (zero rows for numerically-zero directions)
    coef : float32 ``[..., P, S, R]``, ``coef[i] = basis @ (k_i - mu)``
    tau : float32 ``[..., P]``, energy not represented by the basis
    sigma : float32 ``[..., P, min(S, R+1)]``, leading singular values of the centred page
    """
    s = keys.shape[-2]
    if rank > s:
        raise ValueError(f"rank={rank} exceeds page_size={s}")
    # The eigensolve is on an S x S matrix per page; float64 makes the small-sigma directions of
    # low-rank pages exact enough that the basis stays orthonormal (see _REL_SIGMA_FLOOR).
    k = keys.to(torch.float64)
    mu = k.mean(dim=-2)  # [..., P, D]
    dev = k - mu.unsqueeze(-2)  # [..., P, S, D]
    gram = dev @ dev.transpose(-1, -2)  # [..., P, S, S]
    evals, evecs = _eigh(gram)  # ascending
    evals = evals.flip(-1).clamp_min(0.0)  # [..., P, S] descending
    evecs = evecs.flip(-1)
    sig = evals.sqrt()
    sig_r = sig[..., :rank]  # [..., P, R]
    floor = sig[..., :1] * _REL_SIGMA_FLOOR
    keep = (sig_r > floor) & (sig_r > 0)
    safe = torch.where(keep, sig_r, torch.ones_like(sig_r))
    v = (dev.transpose(-1, -2) @ evecs[..., :rank]) / safe.unsqueeze(-2)  # [..., P, D, R]
    v = v * keep.unsqueeze(-2)
    basis = v.transpose(-1, -2)  # [..., P, R, D]
    coef = dev @ v  # [..., P, S, R]
    tau = evals[..., rank:].sum(-1) + (evals[..., :rank] * ~keep).sum(-1)
    sigma = sig[..., : min(s, rank + 1)]
    return mu.float(), basis.float(), coef.float(), tau.float(), sigma.float()


def build_summaries(keys: torch.Tensor, config: LocksConfig) -> PageSummaries:
    """Build (and quantize) LOCKS summaries of full pages.

    Parameters
    ----------
    keys : float tensor ``[..., P, S, D]``
        Post-RoPE keys of full pages, e.g. ``[Hkv, P, S, D]`` or ``[B, Hkv, P, S, D]``.
        ``S`` must equal ``config.page_size``. ``P`` may be 0 (no full page yet).
    config : LocksConfig

    Returns
    -------
    PageSummaries with leading dims ``...`` and P pages.
    """
    check_tensor("keys", keys, 3)
    if keys.shape[-2] != config.page_size:
        raise ValueError(
            f"keys must be full pages [..., P, page_size={config.page_size}, D], got shape {tuple(keys.shape)}"
        )
    d = keys.shape[-1]
    if config.basis_bits in (2, 4) and d % (8 // config.basis_bits):
        raise ValueError(f"head_dim={d} must be a multiple of {8 // config.basis_bits} for {config.basis_bits}-bit basis")
    check_finite("keys", keys)
    mu, basis, coef, tau, sigma = spectral_basis(keys, config.rank)

    if config.basis_bits == 16:
        basis_q, basis_scale = to_fp16_checked("basis", basis), None
    else:
        basis_q, basis_scale = quantize(basis, config.basis_bits, dim=-1)  # scale [..., P, R]
        if config.basis_bits < 8:
            basis_q = pack_bits(basis_q, config.basis_bits)  # [..., P, R, D*bits/8]
    if config.coef_bits == 16:
        coef_q, coef_scale = to_fp16_checked("coefficients", coef), None
        cen_q, cen_scale = to_fp16_checked("centroid", mu), None
    else:
        coef_q, coef_scale = quantize(coef, 8, dim=-1)  # per row: scale [..., P, S]
        cen_q, cen_scale = quantize(mu, 8, dim=-1)  # one scale per page: [..., P]
    return PageSummaries(
        page_size=config.page_size, rank=config.rank, head_dim=d,
        basis_bits=config.basis_bits, coef_bits=config.coef_bits,
        basis=basis_q, basis_scale=basis_scale, coef=coef_q, coef_scale=coef_scale,
        centroid=cen_q, centroid_scale=cen_scale, tau=tau, sigma=sigma,
    )
