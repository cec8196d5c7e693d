"""The decode kernels' head_dim 256 variants compile for sm_90 without a GPU, within its limits.

As ``tests/test_triton_compile.py`` (whose compile helper and signatures this module uses), with
both Tritons, in a child process: the summary build (lean bulk and incremental launches), the
three-dot, packed and centroid score kernels at their D = 256 launches, the split-KV attention at
the steps ``attention.triton.step_pages`` gives the dense launches, its merge, and the exact re-rank. Each cubin's resources (``cuobjdump
-res-usage``) are checked: shared memory within sm_90's 227 KB per block (a launch over it fails
at run time, not at compile time), registers within 255, and spills (local memory) bounded: none
in the attention's default launch, its merge, the re-rank and the centroid and 8-warp packed score
kernels.
"""

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from compile_children import DEVICE_TRITON, ROOT, Children

pytest.importorskip("triton")

SCORE_ARGS = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "basis_ptr": "*u8", "bscale_ptr": "*fp16",
              "coef_ptr": "*i8", "cscale_ptr": "*fp16", "cen_ptr": "*i8", "censcale_ptr": "*fp16", "bt_ptr": "*i32",
              "stride_bt": "i32", "seqlen_ptr": "*i32", "scores_ptr": "*fp32", "stats_ptr": "*fp32", "Hkv": "i32",
              "G": "i32", "max_pages": "i32", "n_chunks": "i32", "pages_per_prog": "i32", "qk_scale": "fp32"}
CENTROID_ARGS = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "cen_ptr": "*i8", "censcale_ptr": "*fp16",
                 "bt_ptr": "*i32", "stride_bt": "i32", "seqlen_ptr": "*i32", "scores_ptr": "*fp32",
                 "stats_ptr": "*fp32", "Hkv": "i32", "G": "i32", "max_pages": "i32", "n_chunks": "i32",
                 "pages_per_prog": "i32", "qk_scale": "fp32", "log2_s": "fp32"}
SHARED_MAX = 232_448  # sm_90: 227 KB of shared memory per block
D = 256


def _resources(cubin: bytes) -> dict:
    """Registers, stack (local memory: spills) and shared bytes of a cubin's kernel (cuobjdump)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    assert m, text
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "shared": int(m.group(3))}


def _check(name: str, k, max_stack: int | None = 0) -> dict:
    """Shared memory within sm_90's per-block limit, registers within 255, and at most ``max_stack``
    bytes of local memory per thread (spills; None: not checked). Prints the resources."""
    res = _resources(k.asm["cubin"])
    res["shared"] = max(res["shared"], k.metadata.shared)
    print(name, res, flush=True)
    assert ".target sm_90" in k.asm["ptx"], name
    assert res["shared"] <= SHARED_MAX and res["regs"] <= 255, (name, res)
    assert max_stack is None or res["stack"] <= max_stack, (name, res)
    return res


def main() -> None:
    import triton.language as tl
    from test_triton_compile import (
        ATTN_ARGS, BUILD_ARGS, EXACT_ARGS, MERGE_KERNEL_ARGS, _compile,
    )

    from kvlocks.attention import triton as at
    from kvlocks.config import DENSE_LAUNCHES
    from kvlocks.scoring import triton as mma, triton_centroid, triton_packed
    from kvlocks.selection import triton_rerank as rr
    from kvlocks.summary import triton as bt

    # the summary build: lean bulk launches (the autotuner's smallest and largest) and the incremental
    # launch (spills allowed: 255 registers at D = 128 already). The one-sided solver, pinned only at
    # D = 256, is left out: its compile took over 6 minutes on a 2-core host (interpreter-tested)
    base = dict(S=16, D=D, R=8, INCREMENTAL=False, WRITE_EIG=False, PRECISION="tf32x3", ONESIDED=False)
    for bp, w in ((1, 1), (4, 4)):
        _check(f"build lean BP={bp} w={w}", _compile(bt._build_kernel, BUILD_ARGS, dict(base, BP=bp), w), None)
    inc = bt.incremental_launch(D, True)
    _check("build lean incremental", _compile(bt._build_kernel, BUILD_ARGS, dict(base, BP=inc["BP"], INCREMENTAL=True),
                                              inc["num_warps"]), None)
    # three-dot score kernel: every D = 256 autotuner launch, bfloat16 and float32 queries
    for dt, c_dt, prec in ((tl.bfloat16, tl.float16, "tf32"), (tl.float32, tl.float32, "ieee")):
        for cfg in mma._MMA_CONFIGS_256:
            k = _compile(mma._score_mma_kernel, dict(SCORE_ARGS, q_ptr="*fp32" if dt == tl.float32 else "*bf16"),
                         dict(GP=16, GB=4, D=D, S=16, R=8, RP=16, DOT_DT=dt, C_DT=c_dt, PRECISION=prec, DH=128, **cfg.kwargs),
                         cfg.num_warps, num_stages=cfg.num_stages)
            # bfloat16: 80 B at 8 warps, 1 KB at 4 with Triton 3.9 (D = 128's BLOCK 32: 1.2 KB);
            # float32 queries spill 9-12 KB (their dots on FMAs): within shared memory is what counts
            _check(f"score mma {dt} {cfg}", k, 2048 if dt == tl.bfloat16 else None)
    # packed score kernel (what "auto" runs on CUDA at D = 256): its launches at G = 1 (FMA
    # contraction), 2 and 4 (page-pair dots) with the inline-PTX unpacking
    for gq, coef in ((1, 2), (2, 3), (4, 3), (8, 3)):
        for cfg in triton_packed._PACKED_CONFIGS_256:
            k = _compile(triton_packed._score_packed_kernel, SCORE_ARGS,
                         dict(GQ=gq, D=D, S=16, R=8, DOT_DT=tl.float16, PREC="tf32", UNPACK=2, COEF=coef,
                              **cfg.kwargs), cfg.num_warps, num_stages=cfg.num_stages)
            _check(f"score packed GQ={gq} {cfg}", k, 0 if cfg.num_warps == 8 else 512)
    k = _compile(triton_centroid._centroid_score_kernel, CENTROID_ARGS,
                 dict(GQ=4, D=D, S=16, BLOCK=triton_centroid.BLOCK, DOT_DT=tl.bfloat16, PREC="tf32"), 4)
    _check("score centroid", k)
    # attention: each dense launch's (pages per step at D = 256, warps, stages), then the merge. The
    # default launch (the decode plan's sparse attention) must not spill; the tuner's other candidates
    # may a little (Triton 3.6: 8 pages, 4 warps steps 4 pages at D = 256 with 360 B of spills)
    # The decode plan's launch also with rows attended over every page (HAS_DENSE: the vLLM step's
    # rows below dense_below), which must not spill either; the tuner's candidates run page lists only.
    default = DENSE_LAUNCHES[0]
    for ppi, warps, stages in sorted({(x.ppi, x.num_warps, x.num_stages) for x in DENSE_LAUNCHES}):
        pp = at.step_pages(ppi, D)
        first = (ppi, warps, stages) == (default.ppi, default.num_warps, default.num_stages)
        for dense in (False, True) if first else (False,):
            k = _compile(at._attn_kernel, ATTN_ARGS, dict(GP=16, D=D, S=16, PP=pp, DOT_DT=tl.bfloat16,
                                                          PRECISION="tf32", HAS_DENSE=dense, PDL=True),
                         warps, num_stages=stages, launch_pdl=True)
            _check(f"attention ppi={ppi} (step {pp}) w={warps} s={stages}{' dense rows' if dense else ''}", k,
                   0 if first else 512)
    _check("attention merge", _compile(at._merge_kernel, MERGE_KERNEL_ARGS, dict(D=D, BLOCK_S=32, S=16, PP=4, HAS_DENSE=True, PDL=True), 4,
                                       launch_pdl=True))
    k = _compile(rr._exact_kernel, EXACT_ARGS, dict(GP=16, D=D, S=16, PB=rr.PAGES_PER_PROGRAM, DOT_DT=tl.bfloat16,
                                                    PRECISION="tf32", PDL=True), 8, launch_pdl=True)
    _check("rerank exact", k)
    import triton

    print("triton", triton.__version__)
    print("compiled")


def _env(extra_path: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([p for p in (extra_path, str(ROOT / "src"), str(ROOT / "tests"),
                                                     env.get("PYTHONPATH", "")) if p])
    return env


CHILDREN = Children(__file__, _env, timeout=1500)


def _compile_all(extra_path: str | None = None) -> str:
    out = CHILDREN.output(extra_path)
    print(out)  # each kernel's resources (pytest -s shows them)
    return out


@pytest.mark.compile_heavy(240)
def test_head_dim_256_kernels_compile_for_sm90():
    _compile_all()


@pytest.mark.compile_heavy(240)
def test_head_dim_256_kernels_compile_for_sm90_with_the_gpu_images_triton():
    """The same with the GPU image's Triton (3.6)."""
    if not (DEVICE_TRITON / "triton").is_dir():
        if os.environ.get("KVLOCKS_REQUIRE_DEVICE_TRITON") == "1":
            pytest.fail(f"{DEVICE_TRITON} is missing: bash scripts/setup_device_triton.sh installs it")
        pytest.skip("the GPU image's Triton is not installed (bash scripts/setup_device_triton.sh; scripts/test.sh does)")
    out = _compile_all(str(DEVICE_TRITON))
    version = (DEVICE_TRITON / ".version").read_text().strip()
    assert f"triton {version}" in out, out[-500:]


if __name__ == "__main__":
    main()
