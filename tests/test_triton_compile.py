"""The selection, summary-build and attention kernels compile for the H200 (sm_90) without a GPU.

The CPU tests run the kernels in the Triton interpreter, which does not lower them; code that is
right in the interpreter can still fail to compile (loop-carried types, casts, layouts). Triton
compiles ahead of time for a named target with its bundled ptxas, so this checks the compiled path
of the selection kernels (the merge on registers and from L2), the fused selection, the summary
build's two solvers (the lean bulk build, the one-sided solver capped as its default launch and in
the incremental launch) and the attention kernel and its merge, with and without programmatic
dependent launch, on CI.

The compile runs in a child process: ``tests/test_kernels.py`` sets ``TRITON_INTERPRET=1`` before
it imports the kernel modules, which turns their ``@triton.jit`` functions into interpreted ones for
the rest of the test session.
"""

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from compile_children import DEVICE_TRITON, ROOT, Children

pytest.importorskip("triton")

MERGE = dict(S=16, K=128, SINK=1, RECENT=1, M=128, TILE=2048, KP=128, SP=1, RP=1, CP=16, HAS_SS=True)
CHUNK_ARGS = {"rank_ptr": "*fp32", "stride_rb": "i32", "stride_rh": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
              "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32"}
MERGE_ARGS = {"seqlen_ptr": "*i32", "ss_ptr": "*i32", "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32",
              "out_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32"}
FUSED_ARGS = {"scores_ptr": "*fp32", "stats_ptr": "*fp32", "n_sc": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
              "ranking_ptr": "*fp32", "lse_ptr": "*fp32", "ckey_ptr": "*i32", "cidx_ptr": "*i32",
              "ccnt_ptr": "*i32", "done_ptr": "*i32", "out_ptr": "*i32", "Hkv": "i32", "G": "i32",
              "max_pages": "i32", "n_chunks": "i32", "lo_pages": "i32", "hi_pages": "i32"}


ATTN_ARGS = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "k_ptr": "*bf16", "v_ptr": "*bf16",
             "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32", "bt_ptr": "*i32", "stride_bt": "i32",
             "seqlen_ptr": "*i32", "pl_ptr": "*i32", "stride_lb": "i32", "stride_lh": "i32", "n_list": "i32",
             "po_ptr": "*fp32", "plse_ptr": "*fp32", "Hkv": "i32", "G": "i32", "n_splits": "i32",
             "pages_per_split": "i32", "qk_scale": "fp32", "sel_ptr": "*i32", "dense_splits": "i32"}


BUILD_ARGS = {"k_ptr": "*bf16", "stride_kp": "i32", "stride_ks": "i32", "stride_kh": "i32", "ids_ptr": "*i32",
              "n_items": "i32", "Hkv": "i32", "bt_ptr": "*i32", "stride_bt": "i32", "basis_ptr": "*u8",
              "bscale_ptr": "*fp16", "coef_ptr": "*i8", "cscale_ptr": "*fp16", "cen_ptr": "*i8",
              "censcale_ptr": "*fp16", "eig_ptr": "*fp32", "n_sweeps": "i32", "floor2": "fp32"}
EXACT_ARGS = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "k_ptr": "*bf16", "stride_kp": "i32",
              "stride_ks": "i32", "stride_kh": "i32", "bt_ptr": "*i32", "stride_bt": "i32", "seqlen_ptr": "*i32",
              "cand_ptr": "*i32", "scores_ptr": "*fp32", "exact_ptr": "*fp32", "est_ptr": "*fp32", "Hkv": "i32",
              "G": "i32", "max_pages": "i32", "KC": "i32", "qk_scale": "fp32"}
PICK_ARGS = {"seqlen_ptr": "*i32", "cand_ptr": "*i32", "exact_ptr": "*fp32", "est_ptr": "*fp32", "lse_ptr": "*fp32",
             "out_ptr": "*i32", "Hkv": "i32", "G": "i32", "KC": "i32"}
MERGE_KERNEL_ARGS = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "out_ptr": "*bf16", "stride_ob": "i32",
                     "stride_oh": "i32", "lse_ptr": "*fp32", "Hq": "i32", "n_splits": "i32", "list_splits": "i32",
                     "seqlen_ptr": "*i32", "sel_ptr": "*i32", "dense_splits": "i32"}


def _compile(fn, args: dict, consts: dict, num_warps: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=dict(args, **{name: "constexpr" for name in consts}), constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def main() -> None:
    """Compile every kernel; assert on the PTX. Run by the test in a process without the interpreter."""
    from kvlocks.selection import fused, triton as sel

    chunk = _compile(sel._chunk_kernel, CHUNK_ARGS,
                     dict(S=16, K=128, SINK=1, RECENT=1, CH=1024, M=128, HAS_SS=False), 8)
    assert len(chunk.asm["cubin"]) > 1000 and ".target sm_90" in chunk.asm["ptx"]
    for regs in (False, True):  # the merge from L2 and on registers
        merge = _compile(sel._merge_kernel, MERGE_ARGS, dict(MERGE, REGS=regs), 8)
        assert len(merge.asm["cubin"]) > 1000 and ".target sm_90" in merge.asm["ptx"]
    for regs, heads, warps, pdl in ((False, 8, 16, False), (True, 4, 8, True)):
        k = _compile(fused._rank_select_kernel, FUSED_ARGS,
                     dict(MERGE, CH=4096, GP=8, RULE=0, BLOCK_K=256, GU=heads, REGS=regs, PDL=pdl), warps,
                     **({"launch_pdl": True} if pdl else {}))
        ptx = k.asm["ptx"]
        assert ".target sm_90" in ptx and len(k.asm["cubin"]) > 1000
        _check_pdl(ptx, pdl)
        # the per-row arrival counter: one thread's acquire-release GPU-scope atomic after a CTA barrier
        at = ptx.index("atom.global.gpu.acq_rel.add")
        assert "bar.sync" in ptx[max(0, at - 400):at]
        assert "ld.global.cg" in ptx  # the merge reads other programs' winners past L1
    build_kernels()
    attention_kernels()
    rerank_kernels()
    import triton

    print("triton", triton.__version__)
    print("compiled")


def build_kernels() -> None:
    """The summary build: the lean solver as its bulk build compiles (1 item, 1 warp), the one-sided
    solver as its default bulk launch (ONESIDED_LAUNCH: a register cap) and as the incremental build
    of pages that fill during decode launches it (4 items, 4 warps)."""
    from kvlocks.summary import triton as bt

    base = dict(S=16, D=128, R=8, BP=1, INCREMENTAL=False, WRITE_EIG=False, PRECISION="tf32x3")
    lean = _compile(bt._build_kernel, BUILD_ARGS, dict(base, ONESIDED=False), 1)
    ptx = lean.asm["ptx"]
    assert ".target sm_90" in ptx and len(lean.asm["cubin"]) > 1000
    assert ("mma.sync" in ptx) or ("wgmma" in ptx)  # the Gram on tensor cores
    assert ".maxnreg" not in ptx
    # the one-sided solver: with Triton >= 3.9 (what torch 2.13 pins) its row swaps are register moves
    # and its only exchange is the pair sums' butterfly shuffles, so the kernel needs (almost) no shared
    # memory, where the Gram solver takes 16 KB. Triton 3.6 (the H200 image's) lowers the swaps through
    # shared memory (2 KB, barriers: docs/benchmarks.md), 3x slower there.
    cap = bt.ONESIDED_LAUNCH["maxnreg"]
    one = _compile(bt._build_kernel, BUILD_ARGS, dict(base, ONESIDED=True), 1, maxnreg=cap)
    assert ".target sm_90" in one.asm["ptx"] and "shfl.sync.bfly" in one.asm["ptx"]
    assert f".maxnreg {cap}" in one.asm["ptx"]
    inc = _compile(bt._build_kernel, BUILD_ARGS, dict(base, BP=4, INCREMENTAL=True, ONESIDED=True), 4)
    assert ".target sm_90" in inc.asm["ptx"] and len(inc.asm["cubin"]) > 1000
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        return
    assert one.metadata.shared <= 1024, one.metadata.shared
    # and in its SASS the solver loop's only shared-memory/shuffle-pipe operations are the pair sums'
    # butterfly shuffles (the Gram solver's loop has shared loads, stores and barriers)
    one_loop, lean_loop = _loop_pipe_ops(one.asm["cubin"]), _loop_pipe_ops(lean.asm["cubin"])
    assert set(one_loop) == {"SHFL.BFLY"}, one_loop
    assert sum(one_loop.values()) == 40 * 15  # 8 pair sums x 5 butterfly levels, 15 steps per trip
    assert any(op.startswith(("LDS", "STS")) for op in lean_loop), lean_loop


def _loop_pipe_ops(cubin: bytes) -> collections.Counter:
    """Shared-memory / shuffle-pipe opcodes (``LDS``, ``STS``, ``LDSM``, ``STSM``, ``SHFL``, ``BAR``)
    of the SASS region the backward branches enclose (the solver loop), from the ``cuobjdump`` that
    ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(.*?);", text)]
    index = {a: i for i, (a, _) in enumerate(lines)}
    loops = []
    for i, (a, t) in enumerate(lines):
        m = re.search(r"BRA .*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))
    assert loops, "no loop found in the SASS"
    lo, hi = min(s for s, _ in loops), max(e for _, e in loops)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in lines[lo: hi + 1]]
    return collections.Counter(op for op in ops if op.startswith(("LDS", "STS", "LDSM", "STSM", "SHFL", "BAR")))


def _check_pdl(ptx: str, pdl: bool) -> None:
    """With programmatic dependent launch (kvlocks.pdl) the kernel waits for the grids ahead before its
    first global load and then lets its dependents launch; without it neither instruction is there."""
    assert ("griddepcontrol.wait" in ptx) == pdl and ("griddepcontrol.launch_dependents" in ptx) == pdl
    if pdl:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
        assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents")


def attention_kernels() -> None:
    """The split-KV attention and its merge kernel, with and without programmatic dependent launch,
    and with rows attended over every page (HAS_DENSE, the vLLM decode step's launch)."""
    import triton.language as tl

    from kvlocks.attention import triton as at

    for pdl, dense in ((False, False), (True, False), (True, True)):
        k = _compile(at._attn_kernel, ATTN_ARGS, dict(GP=16, D=128, S=16, PP=4, DOT_DT=tl.bfloat16, PRECISION="tf32",
                                                      HAS_DENSE=dense, PDL=pdl), 4, num_stages=3,
                     **({"launch_pdl": True} if pdl else {}))
        assert ".target sm_90" in k.asm["ptx"]
        _check_pdl(k.asm["ptx"], pdl)
        k = _compile(at._merge_kernel, MERGE_KERNEL_ARGS, dict(D=128, BLOCK_S=32, S=16, PP=4, HAS_DENSE=dense,
                                                               PDL=pdl), 4,
                     **({"launch_pdl": True} if pdl else {}))
        assert ".target sm_90" in k.asm["ptx"]
        _check_pdl(k.asm["ptx"], pdl)


def rerank_kernels() -> None:
    """The exact re-rank's two kernels (the candidates' exact masses; the combine, top-k and sort), with
    programmatic dependent launch as the decode plan launches them, for G = 4 and 16."""
    import triton.language as tl

    from kvlocks.selection import triton_rerank as rr

    for g, rule in ((4, 0), (16, 2)):
        k = _compile(rr._exact_kernel, EXACT_ARGS, dict(GP=16, D=128, S=16, PB=8, DOT_DT=tl.bfloat16,
                                                        PRECISION="tf32", PDL=True), 4, launch_pdl=True)
        assert ".target sm_90" in k.asm["ptx"] and ("mma" in k.asm["ptx"])
        _check_pdl(k.asm["ptx"], True)
        for radix in (True, False):
            k = _compile(rr._pick_kernel, PICK_ARGS, dict(S=16, K=128, SINK=1, RECENT=1, GP=g, KP=512, RULE=rule,
                                                          RADIX=radix, PDL=True), 8, launch_pdl=True)
            assert ".target sm_90" in k.asm["ptx"] and len(k.asm["cubin"]) > 1000
            _check_pdl(k.asm["ptx"], True)


def _env(extra_path: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([extra_path, str(ROOT / "src"), str(ROOT / "lab" / "src"),
                                             env.get("PYTHONPATH", "")])
    return env


CHILDREN = Children(__file__, _env, timeout=900)


def _compile_all(extra_path: str | None = None) -> str:
    return CHILDREN.output(extra_path)


def test_kernels_compile_for_sm90():
    _compile_all()


def test_kernels_compile_for_sm90_with_the_gpu_images_triton():
    """The same compiles with the H200 image's Triton (3.6), which the GPU runs use: a kernel that
    Triton 3.9 accepts can fail there (e.g. a jit helper's module constant that is no constexpr)."""
    if not (DEVICE_TRITON / "triton").is_dir():
        if os.environ.get("KVLOCKS_REQUIRE_DEVICE_TRITON") == "1":
            pytest.fail(f"{DEVICE_TRITON} is missing: bash scripts/setup_device_triton.sh installs it")
        pytest.skip("the GPU image's Triton is not installed (bash scripts/setup_device_triton.sh; scripts/test.sh does)")
    out = _compile_all(str(DEVICE_TRITON))
    version = (DEVICE_TRITON / ".version").read_text().strip()
    assert f"triton {version}" in out, out[-500:]  # compiled by that Triton, not the venv's


if __name__ == "__main__":
    main()
