"""The selection kernels compile for the H200 (sm_90) without a GPU.

The CPU tests run the kernels in the Triton interpreter, which does not lower them; code that is
right in the interpreter can still fail to compile (loop-carried types, casts, layouts). Triton
compiles ahead of time for a named target with its bundled ptxas, so this checks the compiled path
of every variant of the selection kernels (the early-stopping radix passes, the register merge and 5-bit digits included) on CI.

The compile runs in a child process: ``tests/test_kernels.py`` sets ``TRITON_INTERPRET=1`` before
it imports the kernel modules, which turns their ``@triton.jit`` functions into interpreted ones for
the rest of the test session.
"""

import os
import subprocess
import sys

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


def _compile(fn, args: dict, consts: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=dict(args, **{name: "constexpr" for name in consts}), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main() -> None:
    """Compile every variant; assert on the PTX. Run by the test in a process without the interpreter."""
    from kvlocks.selection import fused, triton as sel

    for early, regs, bits in ((False, False, 4), (True, True, 4), (True, False, 5), (False, True, 5)):
        chunk = _compile(sel._chunk_kernel, CHUNK_ARGS,
                         dict(S=16, K=128, SINK=1, RECENT=1, CH=1024, M=128, HAS_SS=False, EARLY=early, BITS=bits), 8)
        merge = _compile(sel._merge_kernel, MERGE_ARGS, dict(MERGE, EARLY=early, REGS=regs, BITS=bits), 8)
        for k in (chunk, merge):
            assert len(k.asm["cubin"]) > 1000 and ".target sm_90" in k.asm["ptx"]
    for early, regs, bits, heads, warps in ((False, False, 4, 8, 16), (True, True, 5, 0, 8)):
        k = _compile(fused._rank_select_kernel, FUSED_ARGS,
                     dict(MERGE, CH=4096, GP=8, RULE=0, BLOCK_K=256, GU=heads, EARLY=early, REGS=regs, BITS=bits),
                     warps)
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx and len(k.asm["cubin"]) > 1000
        # the per-row arrival counter: one thread's acquire-release GPU-scope atomic after a CTA barrier
        at = ptx.index("atom.global.gpu.acq_rel.add")
        assert "bar.sync" in ptx[max(0, at - 400):at]
        assert "ld.global.cg" in ptx  # the merge reads other programs' winners past L1
    print("compiled")


def test_selection_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


if __name__ == "__main__":
    main()
