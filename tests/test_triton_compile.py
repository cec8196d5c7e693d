"""The selection, summary-build and attention kernels compile for the H200 (sm_90) without a GPU.

The CPU tests run the kernels in the Triton interpreter, which does not lower them; code that is
right in the interpreter can still fail to compile (loop-carried types, casts, layouts). Triton
compiles ahead of time for a named target with its bundled ptxas, so this checks the compiled path
of every variant of the selection kernels (the early-stopping radix passes, the register merge,
5-bit digits and rebased keys included), of the build kernel's options (rotations, the one-sided solver, the dots finish,
a register cap) and of the attention kernel with its in-kernel merge, on CI.

The compile runs in a child process: ``tests/test_kernels.py`` sets ``TRITON_INTERPRET=1`` before
it imports the kernel modules, which turns their ``@triton.jit`` functions into interpreted ones for
the rest of the test session.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

MERGE = dict(S=16, K=128, SINK=1, RECENT=1, M=128, TILE=2048, KP=128, SP=1, RP=1, CP=16, HAS_SS=True)
CHUNK_ARGS = {"rank_ptr": "*fp32", "stride_rb": "i32", "stride_rh": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
              "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32"}
MERGE_ARGS = {"seqlen_ptr": "*i32", "ss_ptr": "*i32", "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32",
              "out_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32"}
FUSED_ARGS = {"scores_ptr": "*fp32", "stats_ptr": "*fp32", "n_sc": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
              "ranking_ptr": "*fp32", "lse_ptr": "*fp32", "ckey_ptr": "*i32", "cidx_ptr": "*i32",
              "ccnt_ptr": "*i32", "done_ptr": "*i32", "out_ptr": "*i32", "Hkv": "i32", "G": "i32",
              "max_pages": "i32", "n_chunks": "i32"}


ATTN_ARGS = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "k_ptr": "*bf16", "v_ptr": "*bf16",
             "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32", "bt_ptr": "*i32", "stride_bt": "i32",
             "seqlen_ptr": "*i32", "pl_ptr": "*i32", "stride_lb": "i32", "stride_lh": "i32", "n_list": "i32",
             "po_ptr": "*fp32", "plse_ptr": "*fp32", "Hkv": "i32", "G": "i32", "n_splits": "i32",
             "pages_per_split": "i32", "qk_scale": "fp32", "done_ptr": "*i32", "out_ptr": "*bf16", "stride_ob": "i32",
             "stride_oh": "i32", "lse_ptr": "*fp32"}


MERGE_KERNEL_ARGS = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16", "stride_ob": "i32",
                     "stride_oh": "i32", "lse_ptr": "*fp32", "Hq": "i32", "n_splits": "i32"}


def _compile(fn, args: dict, consts: dict, num_warps: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=dict(args, **{name: "constexpr" for name in consts}), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def main() -> None:
    """Compile every variant; assert on the PTX. Run by the test in a process without the interpreter."""
    from kvlocks.selection import fused, triton as sel

    for early, regs, bits, rebase in ((False, False, 4, False), (True, True, 4, False), (True, False, 5, True),
                                      (False, True, 5, False), (True, True, 5, True)):
        chunk = _compile(sel._chunk_kernel, CHUNK_ARGS,
                         dict(S=16, K=128, SINK=1, RECENT=1, CH=1024, M=128, HAS_SS=False, EARLY=early, BITS=bits,
                              REBASE=rebase), 8)
        merge = _compile(sel._merge_kernel, MERGE_ARGS, dict(MERGE, EARLY=early, REGS=regs, BITS=bits, REBASE=rebase),
                         8)
        for k in (chunk, merge):
            assert len(k.asm["cubin"]) > 1000 and ".target sm_90" in k.asm["ptx"]
    for early, regs, bits, heads, warps, rebase, pdl in ((False, False, 4, 8, 16, False, False),
                                                         (True, True, 5, 0, 8, True, True)):
        k = _compile(fused._rank_select_kernel, FUSED_ARGS,
                     dict(MERGE, CH=4096, GP=8, RULE=0, BLOCK_K=256, GU=heads, EARLY=early, REGS=regs, BITS=bits,
                          REBASE=rebase, PDL=pdl), warps, **({"launch_pdl": True} if pdl else {}))
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx and len(k.asm["cubin"]) > 1000
        _check_pdl(ptx, pdl)
        # the per-row arrival counter: one thread's acquire-release GPU-scope atomic after a CTA barrier
        at = ptx.index("atom.global.gpu.acq_rel.add")
        assert "bar.sync" in ptx[max(0, at - 400):at]
        assert "ld.global.cg" in ptx  # the merge reads other programs' winners past L1
    build_kernels()
    attention_kernels()
    import triton

    print("triton", triton.__version__)
    print("compiled")


def build_kernels() -> None:
    """The summary build's variants: rotations (round-robin lean, XOR in a loop and unrolled), the
    basis/coefficients finish (per rank, dots), and a capped launch with the volatile reload."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "analysis"))
    import build_sass  # the build kernel's signature and the SASS counts (scripts/analysis/build_sass.py)

    from kvlocks.summary import triton as bt

    BUILD_ARGS = build_sass.SIGNATURE
    base = dict(S=16, D=128, R=8, BP=1, INCREMENTAL=False, WRITE_EIG=False, PRECISION="tf32x3")
    for rot, finish, cap in ((2, 0, None), (2, 1, 128), (3, 1, None), (4, 1, 144)):
        options = {"maxnreg": cap} if cap else {}
        k = _compile(bt._build_kernel, BUILD_ARGS, dict(base, ROT=rot, FINISH=finish, RELOAD_VOLATILE=cap is not None),
                     1, **options)
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx and len(k.asm["cubin"]) > 1000
        assert (f".maxnreg {cap}" in ptx) == (cap is not None)
        assert ("ld.volatile.global" in ptx) == (cap is not None)  # the reload after the solver
        assert ("mma.sync" in ptx) or ("wgmma" in ptx)  # the Gram (and with dots the basis) on tensor cores
    # the one-sided solver: with Triton >= 3.9 (what torch 2.13 pins) its row swaps are register moves
    # and its only exchange is the pair sums' butterfly shuffles, so the kernel needs (almost) no shared
    # memory, where the Gram solvers take 16 KB. Triton 3.6 (the H200 image's) lowers the swaps through
    # shared memory (2 KB, barriers: docs/results/build_sass_triton36.json), 3x slower there.
    # Compiled as the default bulk build launches it (ONESIDED_LAUNCH: register cap), and as the
    # incremental build of pages that fill during decode launches it (4 items, 4 warps).
    cap = bt.ONESIDED_LAUNCH["maxnreg"]
    k = _compile(bt._build_kernel, BUILD_ARGS, dict(base, ROT=5, FINISH=0, RELOAD_VOLATILE=True), 1, maxnreg=cap)
    assert ".target sm_90" in k.asm["ptx"] and "shfl.sync.bfly" in k.asm["ptx"]
    assert f".maxnreg {cap}" in k.asm["ptx"]
    inc = _compile(bt._build_kernel, BUILD_ARGS, dict(base, BP=4, INCREMENTAL=True, ROT=5, FINISH=0, RELOAD_VOLATILE=False),
                   4)
    assert ".target sm_90" in inc.asm["ptx"] and len(inc.asm["cubin"]) > 1000
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        return
    assert k.metadata.shared <= 1024, k.metadata.shared
    # and in its SASS the solver loop's only shared-memory/shuffle-pipe operations are the pair sums'
    # butterfly shuffles (scripts/analysis/build_sass.py; the Gram solver's loop has shared loads,
    # stores and barriers)
    one, lean = build_sass.analyse("onesided"), build_sass.analyse("lean")
    assert set(one["loop_body_pipe_by_op"]) == {"SHFL.BFLY"}, one["loop_body_pipe_by_op"]
    assert one["loop_body_pipe_ops"] == 40 * 15  # 8 pair sums x 5 butterfly levels, 15 steps per trip
    assert any(op.startswith(("LDS", "STS")) for op in lean["loop_body_pipe_by_op"]), lean["loop_body_pipe_by_op"]


def _check_pdl(ptx: str, pdl: bool) -> None:
    """With programmatic dependent launch (kvlocks.pdl) the kernel waits for the grids ahead before its
    first global load and then lets its dependents launch; without it neither instruction is there."""
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def attention_kernels() -> None:
    """The split-KV attention with and without the merge done by each row's last split, and with and
    without programmatic dependent launch (also the separate merge kernel)."""
    import triton.language as tl

    from kvlocks.attention import triton as at

    for merge, pdl in ((False, False), (True, False), (False, True)):
        k = _compile(at._attn_kernel, ATTN_ARGS, dict(GP=16, D=128, S=16, PP=4, DOT_DT=tl.bfloat16, PRECISION="tf32",
                                                      MERGE=merge, PDL=pdl), 4, num_stages=3,
                     **({"launch_pdl": True} if pdl else {}))
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx
        assert ("atom.global.gpu.acq_rel.add" in ptx) == merge and ("ld.global.cg" in ptx) == merge
        _check_pdl(ptx, pdl)
    for pdl in (False, True):
        k = _compile(at._merge_kernel, MERGE_KERNEL_ARGS, dict(D=128, BLOCK_S=32, PDL=pdl), 4,
                     **({"launch_pdl": True} if pdl else {}))
        assert ".target sm_90" in k.asm["ptx"]
        _check_pdl(k.asm["ptx"], pdl)


ROOT = Path(__file__).resolve().parents[1]
DEVICE_TRITON = ROOT / ".venv" / "triton-device"  # scripts/setup_device_triton.sh


def _compile_all(extra_path: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, str(ROOT / "src"), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_kernels_compile_for_sm90():
    _compile_all()


def test_kernels_compile_for_sm90_with_the_gpu_images_triton():
    """The same compiles with the H200 image's Triton (3.6), which the GPU sessions run: a kernel
    that Triton 3.9 accepts can fail there (session 12: a jit helper's constant is no constexpr)."""
    if not (DEVICE_TRITON / "triton").is_dir():
        if os.environ.get("KVLOCKS_REQUIRE_DEVICE_TRITON") == "1":
            pytest.fail(f"{DEVICE_TRITON} is missing: bash scripts/setup_device_triton.sh installs it")
        pytest.skip("the GPU image's Triton is not installed (bash scripts/setup_device_triton.sh; scripts/test.sh does)")
    out = _compile_all(str(DEVICE_TRITON))
    version = (DEVICE_TRITON / ".version").read_text().strip()
    assert f"triton {version}" in out, out[-500:]  # compiled by that Triton, not the venv's


if __name__ == "__main__":
    main()
