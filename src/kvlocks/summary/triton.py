"""Algorithm 1 on the GPU: batched page-summary build with a parallel Jacobi eigensolver, in Triton.

``_build_kernel``, one program per BP (page, KV head) items, writes straight into the paged store:

1. load the page's keys ``[S, D]`` in float32 and centre them (deviations kept as even/odd halves
   of D, so the int4 packing needs no re-interleave);
2. one of two eigensolvers (``KernelOptions.build_solver``; both reproduce the reference's
   summaries within float32 rounding, tests check):

   - ``"lean"`` (:mod:`kvlocks.summary.triton_twosided`): Gram ``dev dev^T [S, S]`` by two batched
     ``tl.dot``s (``tf32x3`` on the GPU: float32-accurate on tensor cores), cyclic parallel Jacobi
     on it (each step rotates the S/2 disjoint pairs of a round-robin tournament, the rotations
     applied through ``tl.gather`` of partner rows/columns, the diagonal tracked in closed form; a
     sweep is S-1 steps and meets every pair once), then basis ``v_r = dev^T u_r / |.|`` and
     coefficients ``dev v_r``, one rank at a time;
   - ``"onesided"`` (:mod:`kvlocks.summary.triton_onesided`): no Gram, the rows of the centred
     keys rotated in XOR pairs until orthogonal, the row swaps register moves and 40 butterfly
     shuffles per step the only exchange; coefficients from the accumulated rotations.

   ``"auto"`` is ``onesided`` with Triton >= 3.9 up to head_dim 128 (launched with a register
   cap, ``ONESIDED_LAUNCH``) and ``lean`` before and at head_dim 256 (``ONESIDED_MAX_D``): on
   the H200, llama3-8b at 1M, whole model, Triton 3.9 one-sided at 168 registers per thread
   0.982 s, uncapped 1.103, lean 1.096; Triton 3.6 lowers the one-sided row swaps through shared
   memory and is 3x slower there (3.52 s vs lean 1.19; docs/benchmarks.md);
3. rank the eigenvalues and keep the top R directions (float32 rounds the Gram at ~1e-7 *
   lambda_1, so a direction with lambda_r <= ``REL_FLOOR**2 * lambda_1`` is dropped as
   numerically zero, like the reference's 1e-6 floor in float64), then int4/int8 quantization
   with float16 scales rounded up, round-half-even like ``torch.round``.

Modes: an explicit list of physical page ids (prefill: every full page), or the incremental build
(decode): per sequence, the page that the last appended token filled, found on the device from
``seq_lens`` and the block table (nothing to do unless ``seq_lens % S == 0``).

Here: the kernel, its launch and the Python entry points; the page loads and quantized stores are
in :mod:`kvlocks.summary.triton_pages`.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from kvlocks.summary.store import SummaryStore
from kvlocks.config import BUILD_SOLVERS, LocksConfig
from kvlocks.kernels_support import check_config
from kvlocks.summary.triton_onesided import _build_onesided
from kvlocks.summary.triton_pages import _dev_halves, _rint, _scale_up
from kvlocks.summary.triton_twosided import _build_lean
from kvlocks.summary.types import PageSummaries

REL_FLOOR = 3e-3  # sigma_r / sigma_1 below this is numerically zero in float32 (see module doc)
SWEEPS = 5  # sweeps of S-1 steps; 16x16 Grams converge to float32 accuracy in 5 (tests check)


@triton.jit
def _build_kernel(k_ptr, stride_kp, stride_ks, stride_kh, ids_ptr, n_items, Hkv, bt_ptr, stride_bt,
                  basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr, censcale_ptr, eig_ptr, n_sweeps,
                  floor2, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BP: tl.constexpr,
                  INCREMENTAL: tl.constexpr, WRITE_EIG: tl.constexpr, PRECISION: tl.constexpr,
                  ONESIDED: tl.constexpr):
    it = tl.program_id(0) * BP + tl.arange(0, BP)
    im = it < n_items
    i = it // Hkv
    h = it % Hkv
    if INCREMENTAL:  # ids_ptr = seq_lens: the page the last token filled, if it filled one
        n = tl.load(ids_ptr + i, mask=im, other=0)
        filled = im & (n > 0) & (n % S == 0)
        phys = tl.load(bt_ptr + i.to(tl.int64) * stride_bt + tl.maximum(n // S - 1, 0), mask=filled, other=-1)
    else:
        phys = tl.load(ids_ptr + i, mask=im, other=-1)
    ok = phys >= 0
    if tl.max(ok.to(tl.int32), axis=0) > 0:  # skip the solver when no item has a page (most decode steps)
        ph = tl.maximum(phys, 0).to(tl.int64) * Hkv + h  # store record (page, head)
        base = tl.maximum(phys, 0).to(tl.int64) * stride_kp + h * stride_kh
        s_idx = tl.arange(0, S)
        j = tl.arange(0, D // 2)
        de, do, mue, muo = _dev_halves(k_ptr, base, ok, s_idx, j, stride_ks, S)
        if ONESIDED:
            lam, rank = _build_onesided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, basis_ptr, bscale_ptr,
                                        coef_ptr, cscale_ptr, BP, S, D, R)
            if WRITE_EIG:
                tl.store(eig_ptr + it[:, None].to(tl.int64) * S + rank, lam, mask=im[:, None])
        else:
            _build_lean(de, do, n_sweeps, floor2, ph, ok, j, s_idx, it, im, base, k_ptr, stride_ks, eig_ptr,
                        basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, S, D, R, BP, WRITE_EIG, PRECISION)
        ms16, ms = _scale_up(tl.maximum(tl.max(tl.abs(mue), axis=1), tl.max(tl.abs(muo), axis=1)) / 127.0)
        ce = tl.minimum(tl.maximum(_rint(mue / ms[:, None]), -127.0), 127.0).to(tl.int8)
        co = tl.minimum(tl.maximum(_rint(muo / ms[:, None]), -127.0), 127.0).to(tl.int8)
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :], ce, mask=ok[:, None])
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :] + 1, co, mask=ok[:, None])
        tl.store(censcale_ptr + ph, ms16, mask=ok)


# Lean bulk builds on CUDA tune items per program and warps once per shape (the kernel rewrites its
# outputs, so re-running it while tuning is harmless); incremental builds keep a fixed launch. Fewer
# items and warps per program won on the H200 (per llama3-8b layer at 1M: 1 x 1: 37 ms, 2 x 2: 55,
# 4 x 4: 63, 8 x 8: 91): uncapped, a 1-warp program takes 255 registers with Triton 3.6 (176 with
# Triton 3.9), so an SM holds 8 of them.
_BUILD_CONFIGS = [triton.Config({"BP": bp}, num_warps=w) for bp, w in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 4))]
_build_tuned = triton.autotune(_BUILD_CONFIGS, key=["Hkv", "S", "D", "R", "WRITE_EIG", "ONESIDED"])(_build_kernel)
# The one-sided bulk build's CUDA launch (fixed, not tuned: the tuner would compile each candidate,
# ~40-80 s apiece for this solver): one (page, head) per 1-warp program, registers capped so that
# more programs are resident: uncapped it takes 255 (8 programs per SM), at 168 it fits 12 per SM
# with 216 B of stack per thread. Caps 144-208 timed on the H200 (llama3-8b at 1M, docs/benchmarks.md):
# 168 fastest (0.982 s); 160 (also 12 per SM, more spills) 0.993 s, 176 (11 per SM) 1.111 s.
ONESIDED_LAUNCH = {"BP": 1, "num_warps": 1, "maxnreg": 168}
# The one-sided solver up to head_dim 128 only. At 256 it keeps the centred keys [S, D] float32 in
# registers through the sweeps (128 values per thread of a 1-warp program; at 128 it needs 255
# registers uncapped already), and its 5 sweeps do not converge on every page: a page of random
# bfloat16 keys (8th/9th eigenvalue gap 1.8 % of the largest) needed 20 sweeps, at 5 and 10 its
# rank-8 reconstruction was 0.28 off the float64 reference's (lean: exact at 5). Lean holds the
# 16 x 16 Gram and eigenvectors whatever D is and re-reads the keys for the basis.
ONESIDED_MAX_D = 128


def incremental_launch(head_dim: int, cuda: bool) -> dict:
    """The fixed launch of builds that are not autotuned (the incremental build, CPU builds): 4
    items per 4-warp program on CUDA (2 at head_dim 256, so that the items' keys ``[BP, S, D]``
    float32 stay at 64 values per thread), 2 on the CPU."""
    return {"BP": (4 if head_dim <= 128 else 2) if cuda else 2, "num_warps": 4}


def tuned_launch():
    """The launch configuration the lean bulk build's autotuner chose last (None before a tuned CUDA build)."""
    return getattr(_build_tuned, "best_config", None)


def _triton_version() -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    return major, minor


def resolve_solver(solver: str = "auto", head_dim: int = 128) -> str:
    """``"lean"`` or ``"onesided"``; ``"auto"``: one-sided with Triton >= 3.9 up to head_dim 128,
    lean before and at head_dim 256 (:data:`ONESIDED_MAX_D`); ``"onesided"`` above it is refused."""
    if solver not in BUILD_SOLVERS:
        raise ValueError(f"solver={solver!r}: allowed {BUILD_SOLVERS}")
    if solver == "auto":
        return "onesided" if _triton_version() >= (3, 9) and head_dim <= ONESIDED_MAX_D else "lean"
    if solver == "onesided" and head_dim > ONESIDED_MAX_D:
        raise ValueError(f"build_solver='onesided' at head_dim={head_dim}: the one-sided solver takes head_dim "
                         f"up to {ONESIDED_MAX_D} (its sweeps leave some pages unconverged at 256); use 'lean' "
                         "or 'auto'")
    return solver


def _launch(k_cache, store, ids, n_items, table, incremental, eig=None, sweeps=SWEEPS, solver="auto", launch=None):
    _, s, hkv, d = k_cache.shape
    onesided = resolve_solver(solver, d) == "onesided"
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache needs a contiguous last dim")
    prec = "tf32x3" if k_cache.is_cuda else "ieee"
    tb = table if table is not None else ids
    tuned = k_cache.is_cuda and not incremental and not launch
    if tuned and onesided:
        tuned, launch = False, ONESIDED_LAUNCH
    kernel = _build_tuned if tuned else _build_kernel
    launch = {} if tuned else dict(launch or incremental_launch(d, k_cache.is_cuda))
    kernel[lambda meta: (triton.cdiv(max(n_items, 1), meta["BP"]),)](
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ids, n_items, hkv, tb,
        tb.stride(0) if table is not None else 0, store.basis, store.basis_scale, store.coef, store.coef_scale,
        store.centroid, store.centroid_scale, eig if eig is not None else store.coef_scale, sweeps, REL_FLOOR**2,
        S=s, D=d, R=store.rank, INCREMENTAL=incremental, WRITE_EIG=eig is not None, PRECISION=prec,
        ONESIDED=onesided, **launch,
    )


def build_pages(k_cache: torch.Tensor, store: SummaryStore, page_ids: torch.Tensor, *, eig=None,
                sweeps: int = SWEEPS, solver: str = "auto", launch: dict | None = None) -> None:
    """Build the summaries of physical pages ``page_ids [N]`` int32 (-1 = skip), all KV heads.

    k_cache : ``[num_pages, S, Hkv, D]``; writes ``store`` at those page ids. ``eig``: optional
    float32 ``[N * Hkv, S]`` receiving each page's Gram eigenvalues in descending order.
    ``solver``: ``"auto"``, ``"lean"`` or ``"onesided"`` (:func:`resolve_solver`). ``launch``: a
    fixed ``BP`` / ``num_warps`` (/ ``maxnreg``) instead of the default launch (CUDA bulk builds:
    autotuned for lean, ``ONESIDED_LAUNCH`` for one-sided).
    """
    _launch(k_cache, store, page_ids, page_ids.numel() * k_cache.shape[2], None, False, eig, sweeps, solver, launch)


def build_new_pages(k_cache: torch.Tensor, store: SummaryStore, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, *, solver: str = "auto") -> None:
    """Incremental build during decode: for each sequence whose length is a positive multiple of S
    (its last page just filled), build that page. Grid ``B * Hkv`` items; no host sync."""
    _launch(k_cache, store, seq_lens, seq_lens.numel() * k_cache.shape[2], block_table, True, solver=solver)


def build_summaries(keys: torch.Tensor, config: LocksConfig, *, solver: str = "auto") -> PageSummaries:
    """Same as :func:`kvlocks.summary.build.build_summaries` (int4/int8): ``[..., P, S, D]`` pages."""
    check_config(config, keys.shape[-1], backend="triton")
    *lead, p, s, d = keys.shape
    rows = 1
    for x in lead:
        rows *= x
    cache = keys.reshape(rows * p, s, 1, d)
    store = SummaryStore.empty(rows * p, 1, d, config, device=keys.device)
    eig = torch.zeros(rows * p, s, device=keys.device)
    ids = torch.arange(rows * p, dtype=torch.int32, device=keys.device)
    if rows * p:
        build_pages(cache, store, ids, eig=eig, solver=solver)
    lam = eig.clamp_min(0.0).view(*lead, p, s)
    r = config.rank
    kept = lam[..., :r] > (REL_FLOOR**2) * lam[..., :1]
    tau = lam[..., r:].sum(-1) + (lam[..., :r] * ~kept).sum(-1)

    def unflat(t):
        return t.reshape(*lead, p, *t.shape[2:])

    return PageSummaries(
        page_size=s, rank=r, head_dim=d, basis_bits=4, coef_bits=8,
        basis=unflat(store.basis), basis_scale=unflat(store.basis_scale), coef=unflat(store.coef),
        coef_scale=unflat(store.coef_scale), centroid=unflat(store.centroid),
        centroid_scale=unflat(store.centroid_scale), tau=tau, sigma=lam[..., : min(s, r + 1)].sqrt(),
    )
