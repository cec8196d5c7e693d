"""Building the CUDA sources with nvcc (kvlocks._nvcc): compile, cache, and clear errors.

Needs nvcc (not a GPU): compiling for sm_90 checks the CUDA score kernel's source on any machine
with the CUDA toolkit. Its results are checked on the GPU (tests/test_kernels.py).
"""

import ctypes

import pytest

from kvlocks import _nvcc
from kvlocks.scoring import cuda_mma

NVCC = _nvcc.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


@needs_nvcc
def test_score_kernel_source_compiles_and_exports_its_entry_points(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCKS_CACHE", str(tmp_path))
    lib_path = _nvcc.compile_library(cuda_mma.SOURCE, "sm_90")
    assert lib_path.parent == tmp_path / "cuda" and lib_path.stat().st_size > 0
    assert _nvcc.compile_library(cuda_mma.SOURCE, "sm_90") == lib_path  # cached: same file, no recompile
    lib = ctypes.CDLL(str(lib_path))
    for name in ("kvlocks_score_mma", "kvlocks_score_mma_blocks_per_sm", "kvlocks_error_string"):
        assert hasattr(lib, name), name


def test_ctypes_declarations_match_the_c_entry_points():
    """Every argtypes list declared for the score library has as many entries as its C function has
    parameters (a mismatch fails only at the first launch on a GPU)."""
    import re
    from types import SimpleNamespace

    text = cuda_mma.SOURCE.read_text()
    lib = SimpleNamespace(kvlocks_score_mma=SimpleNamespace(), kvlocks_score_mma_blocks_per_sm=SimpleNamespace())
    cuda_mma._declare(lib)
    for name in ("kvlocks_score_mma", "kvlocks_score_mma_blocks_per_sm"):
        params = re.search(rf"\b{name}\(([^)]*)\)\s*\{{", text).group(1)
        assert len(getattr(lib, name).argtypes) == params.count(",") + 1, name


def test_cuda_source_reports_why_it_is_unavailable_off_the_gpu():
    """On a CPU device the CUDA score library says it is unavailable and why (the caller then runs the
    Triton kernels); no compile is attempted."""
    assert cuda_mma.available("cpu") is False
    assert cuda_mma.unavailable_reason("cpu") == "not a CUDA device"


@needs_nvcc
def test_compile_error_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCKS_CACHE", str(tmp_path))
    bad = tmp_path / "broken.cu"
    bad.write_text("__global__ void k() { this is not C++ }\n")
    with pytest.raises(_nvcc.NvccUnavailable, match="broken.cu"):
        _nvcc.compile_library(bad, "sm_90")
    assert not list((tmp_path / "cuda").glob("broken*.so"))  # nothing half-written left in the cache


def test_missing_or_broken_nvcc_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLOCKS_NVCC", str(tmp_path / "no-such-nvcc"))
    _nvcc._nvcc_version.cache_clear()
    with pytest.raises(_nvcc.NvccUnavailable, match="no-such-nvcc"):
        _nvcc.compile_library(cuda_mma.SOURCE, "sm_90")


def test_six_blocks_variant_only_where_compiled():
    """The six-blocks-per-SM score kernel exists for D = 128, G <= 8, 4 warps; other shapes fall back
    to the default variant, and other requests are refused with what is allowed."""
    assert cuda_mma.variant_min_blocks(128, 8, 4, 6) == 6
    assert cuda_mma.variant_min_blocks(128, 12, 4, 6) == 1  # two n-tiles of heads
    assert cuda_mma.variant_min_blocks(64, 4, 4, 6) == 1
    assert cuda_mma.variant_min_blocks(128, 4, 2, 6) == 1
    assert cuda_mma.variant_min_blocks(128, 4, 4, 1) == 1
    with pytest.raises(ValueError, match="allowed 1 or 6"):
        cuda_mma.variant_min_blocks(128, 4, 4, 5)



@needs_nvcc
def test_score_kernel_chains_variant_compiles_and_bad_values_are_refused(tmp_path, monkeypatch):
    """KVLOCKS_SCORE_CHAINS (the projections' accumulator chains, a variant timed on the GPU by
    scripts/device/mma_probe.py --sources): 4 compiles; any value but 2 or 4 stops the build with the
    static_assert's message."""
    monkeypatch.setenv("KVLOCKS_CACHE", str(tmp_path))
    text = cuda_mma.SOURCE.read_text()
    four = tmp_path / "score_chains4.cu"
    four.write_text("#define KVLOCKS_SCORE_CHAINS 4\n" + text)
    assert hasattr(ctypes.CDLL(str(_nvcc.compile_library(four, "sm_90"))), "kvlocks_score_mma")
    three = tmp_path / "score_chains3.cu"
    three.write_text("#define KVLOCKS_SCORE_CHAINS 3\n" + text)
    with pytest.raises(_nvcc.NvccUnavailable, match="KVLOCKS_SCORE_CHAINS: 2 or 4"):
        _nvcc.compile_library(three, "sm_90")
