"""Algorithm 1 on the GPU: batched page-summary build with a parallel Jacobi eigensolver, in Triton.

``_build_kernel``, one program per BP (page, KV head) items, writes straight into the paged store:

1. load the page's keys ``[S, D]`` in float32, centre them (deviations kept as even/odd halves
   of D, so the int4 packing needs no re-interleave), Gram ``dev dev^T [S, S]`` by two batched
   ``tl.dot``s (``tf32x3`` on the GPU: float32-accurate on tensor cores);
2. cyclic parallel Jacobi on the Gram: each step rotates the S/2 disjoint pairs of a round-robin
   tournament (partner(i) = (2t - i) mod (S-1), with S-1 meeting t), the rotations applied as
   ``A <- J^T A J`` and ``V <- V J`` through ``tl.gather`` of the partner rows/columns; a sweep is
   S-1 steps and meets every pair once. Variants (``ROTATIONS``, same rotations, results equal up to
   float32 rounding): ``lean`` (diagonal tracked in closed form, one reduction per step, 284 SASS
   instructions per thread per step for sm_90), ``gathers`` (four masked reductions per step, 468)
   and ``dots`` (rotations as tf32x3 batched dots, 733). H200, whole model at 1M
   (``scripts/device/build_probe.py``, Triton 3.6): lean 1.18 s (llama3-8b) / 0.75 s (glm4-9b-1m) at
   1 item x 1 warp per program (the autotuner's pick), 1.76 / 1.11 s at 2 x 2; gathers 2.51 / 1.57 s,
   dots 2.29 / 1.44 s at 4 x 4. Prepared, off: ``xor`` / ``xor_unrolled``, the pairs of step m as
   (i, i XOR m) (215 / 191 instructions per step; see ``_jacobi_xor``). And ``onesided``
   (:func:`_build_onesided`): no Gram, the rows of the centred keys rotated until orthogonal, the
   row swaps register moves and 40 butterfly shuffles per step the only exchange (the Gram solvers:
   67 shared-memory/shuffle operations per step); it reproduces the float64 reference exactly on
   pages where lean is near the test tolerance. The default (``ROTATION``) is ``onesided`` with
   Triton >= 3.9 (launched with a register cap, ``ONESIDED_LAUNCH``) and ``lean`` before: Triton
   3.6's layout conversions turn the one-sided row swaps into shared-memory traffic (2.6x lean's
   instructions, 3x slower);
3. rank the eigenvalues, take the top R eigenvectors u_r, basis ``v_r = dev^T u_r / |.|`` (float32
   rounds the Gram at ~1e-7 * lambda_1, so a direction with lambda_r <= ``rel_floor**2 *
   lambda_1`` is dropped as numerically zero, like the reference's 1e-6 floor in float64),
   coefficients ``dev v_r`` (the projection, as in the reference), one rank at a time (``FINISH =
   "loop"``) or all at once as batched tf32x3 dots (``"dots"``, prepared, off), then int4/int8
   quantization with float16 scales rounded up, round-half-even like ``torch.round``.

Modes: an explicit list of physical page ids (prefill: every full page), or the incremental build
(decode): per sequence, the page that the last appended token filled, found on the device from
``seq_lens`` and the block table (nothing to do unless ``seq_lens % S == 0``).

Here: the kernel, its launch and the Python entry points. The solvers are in
:mod:`kvlocks.summary.triton_twosided` (Gram, rotations 0-4, and the basis/coefficient finishes) and
:mod:`kvlocks.summary.triton_onesided` (rotation 5); the page loads and quantized stores in
:mod:`kvlocks.summary.triton_pages`.
"""

from __future__ import annotations

import re

import torch
import triton
import triton.language as tl

from kvlocks.config import LocksConfig
from kvlocks.cache.layout import PagedSummaries, check_kernel_config
from kvlocks.summary.triton_onesided import _build_onesided
from kvlocks.summary.triton_pages import _dev_halves, _rint, _scale_up
from kvlocks.summary.triton_twosided import _build_twosided
from kvlocks.summary.types import PageSummaries

REL_FLOOR = 3e-3  # sigma_r / sigma_1 below this is numerically zero in float32 (see module doc)
SWEEPS = 5  # sweeps of S-1 steps; 16x16 Grams converge to float32 accuracy in 5 (tests check)


@triton.jit
def _build_kernel(k_ptr, stride_kp, stride_ks, stride_kh, ids_ptr, n_items, Hkv, bt_ptr, stride_bt,
                  basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, cen_ptr, censcale_ptr, eig_ptr, n_sweeps,
                  floor2, S: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BP: tl.constexpr,
                  INCREMENTAL: tl.constexpr, WRITE_EIG: tl.constexpr, PRECISION: tl.constexpr,
                  ROT: tl.constexpr = 0, FINISH: tl.constexpr = 0,
                  RELOAD_VOLATILE: tl.constexpr = False):
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
        if ROT == 5:
            lam, rank = _build_onesided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, basis_ptr, bscale_ptr,
                                        coef_ptr, cscale_ptr, BP, S, D, R)
            if WRITE_EIG:
                tl.store(eig_ptr + it[:, None].to(tl.int64) * S + rank, lam, mask=im[:, None])
        else:
            _build_twosided(de, do, n_sweeps, floor2, ph, ok, j, s_idx, it, im, base, k_ptr, stride_ks, eig_ptr,
                            basis_ptr, bscale_ptr, coef_ptr, cscale_ptr, S, D, R, BP, WRITE_EIG, PRECISION, ROT,
                            FINISH, RELOAD_VOLATILE)
        ms16, ms = _scale_up(tl.maximum(tl.max(tl.abs(mue), axis=1), tl.max(tl.abs(muo), axis=1)) / 127.0)
        ce = tl.minimum(tl.maximum(_rint(mue / ms[:, None]), -127.0), 127.0).to(tl.int8)
        co = tl.minimum(tl.maximum(_rint(muo / ms[:, None]), -127.0), 127.0).to(tl.int8)
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :], ce, mask=ok[:, None])
        tl.store(cen_ptr + ph[:, None] * D + 2 * j[None, :] + 1, co, mask=ok[:, None])
        tl.store(censcale_ptr + ph, ms16, mask=ok)


# Bulk builds on CUDA tune items per program, warps and a register cap once per shape (the kernel
# rewrites its outputs, so re-running it while tuning is harmless); incremental builds keep a fixed
# launch. Fewer items and warps per program won for the lean rotations on the H200 (per llama3-8b
# layer at 1M: 1 x 1: 37 ms, 2 x 2: 55, 4 x 4: 63, 8 x 8: 91). Uncapped, a 1-warp program takes 255
# registers with Triton 3.6 (the Gram's tf32x3 operands; 176 with Triton 3.9), so an SM holds 8 of them and each scheduler has 2 warps to
# hide the solver's shuffle and shared-memory latency; capped at 144 (or 128) the solver loop still
# spills nothing (sm_90 SASS; spills only before and after it) and 14 fit (then shared memory, 16 KB
# per program, is the limit).
# ``REGISTER_CAPS`` (prepared, off until measured on the GPU) adds the capped launches to the tuning.
_BUILD_CONFIGS = [triton.Config({"BP": bp}, num_warps=w) for bp, w in ((1, 1), (1, 2), (2, 1), (2, 2), (4, 4))]
_CAPPED_CONFIGS = [triton.Config({"BP": 1, "RELOAD_VOLATILE": True}, num_warps=1, maxnreg=m) for m in (144, 128)]
_TUNE_KEY = ["Hkv", "S", "D", "R", "WRITE_EIG", "ROT", "FINISH"]
_build_tuned = triton.autotune(_BUILD_CONFIGS, key=_TUNE_KEY)(_build_kernel)
_build_tuned_caps = triton.autotune(_BUILD_CONFIGS + _CAPPED_CONFIGS, key=_TUNE_KEY)(_build_kernel)
REGISTER_CAPS = False
# how Jacobi rotates: _jacobi_gathers / _dots / _lean / _xor (runtime loop) / _xor (steps unrolled) on the
# Gram, or _build_onesided on the keys (no Gram; its own basis/coefficients: FINISH does not apply)
ROTATIONS = {"gathers": 0, "dots": 1, "lean": 2, "xor": 3, "xor_unrolled": 4, "onesided": 5}


def _triton_version() -> tuple[int, int]:
    major, minor = (int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    return major, minor


# One-sided with Triton >= 3.9 (what torch 2.13 installs), lean before: on the H200, llama3-8b at 1M,
# whole model (session 13, cubins compiled by each Triton and launched through CuPy,
# scripts/device/cubin_probe.py): Triton 3.9 one-sided at 168 registers per thread 0.982 s, uncapped
# 1.103, lean 1.096 (capped at 128: 1.267); Triton 3.6 lowers the one-sided row swaps through shared
# memory and is 3x slower there (3.52 s vs lean 1.19).
ROTATION = "onesided" if _triton_version() >= (3, 9) else "lean"
# The one-sided bulk build's CUDA launch (fixed, not tuned: the tuner would compile each candidate,
# ~40-80 s apiece for this solver): one (page, head) per 1-warp program, registers capped so that
# more programs are resident: uncapped it takes 255 (8 programs per SM, two warps per scheduler,
# latency-bound), at 168 it fits 12 per SM with 216 B of stack per thread. Caps 144-208 timed
# (docs/benchmarks.md, session 13): 168 fastest; 160 (also 12 per SM, more spills) 0.993 s, 176
# (11 per SM) 1.111 s.
ONESIDED_LAUNCH = {"BP": 1, "num_warps": 1, "maxnreg": 168}
FINISHES = {"loop": 0, "dots": 1}  # basis and coefficients: _basis_coefs_loop / _basis_coefs_dots
FINISH = "loop"  # "dots": prepared, off until measured on the GPU


def _rot(rotation: str | None) -> int:
    rotation = ROTATION if rotation is None else rotation
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r}: allowed {tuple(ROTATIONS)}")
    return ROTATIONS[rotation]


def _launch(k_cache, store, ids, n_items, table, incremental, eig=None, sweeps=SWEEPS, rotation=None, launch=None,
            finish=None):
    _, s, hkv, d = k_cache.shape
    rot = _rot(rotation)
    finish = FINISH if finish is None else finish
    if finish not in FINISHES:
        raise ValueError(f"finish={finish!r}: allowed {tuple(FINISHES)}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache needs a contiguous last dim")
    prec = "tf32x3" if k_cache.is_cuda else "ieee"
    tb = table if table is not None else ids
    tuned = k_cache.is_cuda and not incremental and not launch
    if tuned and rot == ROTATIONS["onesided"]:
        tuned, launch = False, ONESIDED_LAUNCH
    kernel = (_build_tuned_caps if REGISTER_CAPS else _build_tuned) if tuned else _build_kernel
    launch = {} if tuned else dict(launch or {"BP": 4 if k_cache.is_cuda else 2, "num_warps": 4})
    if "maxnreg" in launch:  # capped: reload the keys after the solver rather than keep them live
        launch.setdefault("RELOAD_VOLATILE", True)
    kernel[lambda meta: (triton.cdiv(max(n_items, 1), meta["BP"]),)](
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ids, n_items, hkv, tb,
        tb.stride(0) if table is not None else 0, store.basis, store.basis_scale, store.coef, store.coef_scale,
        store.centroid, store.centroid_scale, eig if eig is not None else store.coef_scale, sweeps, REL_FLOOR**2,
        S=s, D=d, R=store.rank, INCREMENTAL=incremental, WRITE_EIG=eig is not None, PRECISION=prec, ROT=rot,
        FINISH=FINISHES[finish],
        **launch,
    )


def build_pages(k_cache: torch.Tensor, store: PagedSummaries, page_ids: torch.Tensor, *, eig=None,
                sweeps: int = SWEEPS, rotation: str | None = None, launch: dict | None = None,
                finish: str | None = None) -> None:
    """Build the summaries of physical pages ``page_ids [N]`` int32 (-1 = skip), all KV heads.

    k_cache : ``[num_pages, S, Hkv, D]``; writes ``store`` at those page ids. ``eig``: optional
    float32 ``[N * Hkv, S]`` receiving each page's Gram eigenvalues in descending order.
    ``rotation``: a key of :data:`ROTATIONS`; None = :data:`ROTATION`. ``launch``: fixed ``BP`` /
    ``num_warps`` instead of the autotuned launch (CUDA bulk builds). ``finish``: a key of
    :data:`FINISHES` (how basis and coefficients are formed); None = :data:`FINISH`.
    """
    _launch(k_cache, store, page_ids, page_ids.numel() * k_cache.shape[2], None, False, eig, sweeps, rotation,
            launch, finish)


def build_new_pages(k_cache: torch.Tensor, store: PagedSummaries, block_table: torch.Tensor,
                    seq_lens: torch.Tensor) -> None:
    """Incremental build during decode: for each sequence whose length is a positive multiple of S
    (its last page just filled), build that page. Grid ``B * Hkv`` items; no host sync."""
    _launch(k_cache, store, seq_lens, seq_lens.numel() * k_cache.shape[2], block_table, True)


def build_summaries(keys: torch.Tensor, config: LocksConfig, *, rotation: str | None = None,
                    finish: str | None = None) -> PageSummaries:
    """Same as :func:`kvlocks.summary.build.build_summaries` (int4/int8): ``[..., P, S, D]`` pages."""
    check_kernel_config(config, keys.shape[-1])
    *lead, p, s, d = keys.shape
    rows = 1
    for x in lead:
        rows *= x
    cache = keys.reshape(rows * p, s, 1, d)
    store = PagedSummaries.empty(rows * p, 1, d, config, device=keys.device)
    eig = torch.zeros(rows * p, s, device=keys.device)
    ids = torch.arange(rows * p, dtype=torch.int32, device=keys.device)
    if rows * p:
        build_pages(cache, store, ids, eig=eig, rotation=rotation, finish=finish)
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
