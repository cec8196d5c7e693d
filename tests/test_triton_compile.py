"""The selection kernels compile for the H200 (sm_90) without a GPU.

The CPU tests run the kernels in the Triton interpreter, which does not lower them; code that is
right in the interpreter can still fail to compile (loop-carried types, casts, layouts). Triton
compiles ahead of time for a named target with its bundled ptxas, so this checks the compiled path
of every variant of the selection kernels (the early-stopping radix passes included) on CI.
"""

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from kvlocks.selection import fused, triton as sel  # noqa: E402

SM90 = backends.GPUTarget("cuda", 90, 32)
MERGE = dict(S=16, K=128, SINK=1, RECENT=1, M=128, TILE=2048, KP=128, SP=1, RP=1, CP=16, HAS_SS=True)


def _compile(fn, args: dict, consts: dict, num_warps: int):
    sig = dict(args, **{name: "constexpr" for name in consts})
    src = compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=SM90, options={"num_warps": num_warps})


@pytest.mark.parametrize("early", [False, True])
def test_chunk_and_merge_kernels_compile_for_sm90(early):
    chunk = _compile(sel._chunk_kernel, {
        "rank_ptr": "*fp32", "stride_rb": "i32", "stride_rh": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
        "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32",
    }, dict(S=16, K=128, SINK=1, RECENT=1, CH=1024, M=128, HAS_SS=False, EARLY=early), 8)
    merge = _compile(sel._merge_kernel, {
        "seqlen_ptr": "*i32", "ss_ptr": "*i32", "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32",
        "out_ptr": "*i32", "Hkv": "i32", "n_chunks": "i32",
    }, dict(MERGE, EARLY=early), 8)
    for k in (chunk, merge):
        assert len(k.asm["cubin"]) > 1000 and ".target sm_90" in k.asm["ptx"]


@pytest.mark.parametrize("early,heads,warps", [(False, 8, 16), (True, 0, 8)])
def test_fused_rank_select_kernel_compiles_for_sm90(early, heads, warps):
    k = _compile(fused._rank_select_kernel, {
        "scores_ptr": "*fp32", "stats_ptr": "*fp32", "n_sc": "i32", "seqlen_ptr": "*i32", "ss_ptr": "*i32",
        "ranking_ptr": "*fp32", "lse_ptr": "*fp32", "ckey_ptr": "*i32", "cidx_ptr": "*i32", "ccnt_ptr": "*i32",
        "done_ptr": "*i32", "out_ptr": "*i32", "Hkv": "i32", "G": "i32", "max_pages": "i32", "n_chunks": "i32",
    }, dict(MERGE, CH=4096, GP=8, RULE=0, BLOCK_K=256, GU=heads, EARLY=early), warps)
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    assert "atom" in ptx and "acq_rel" in ptx  # the per-row arrival counter: acquire-release at GPU scope
    assert "ld.global.cg" in ptx  # the merge reads other programs' winners past L1
    assert len(k.asm["cubin"]) > 1000
