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


@needs_nvcc
def test_nvcc_and_cache_dir_from_the_environment(tmp_path, monkeypatch):
    """``KVLOCKS_NVCC`` picks the compiler and ``KVLOCKS_CACHE`` the library cache (both read through
    kvlocks.env; unset, the cache is ``~/.cache/kvlocks``)."""
    monkeypatch.setenv("KVLOCKS_NVCC", NVCC)
    assert _nvcc.find_nvcc() == NVCC
    monkeypatch.setenv("KVLOCKS_CACHE", str(tmp_path / "c"))
    assert _nvcc.cache_dir() == tmp_path / "c" / "cuda"
    monkeypatch.delenv("KVLOCKS_CACHE")
    assert str(_nvcc.cache_dir()).endswith(".cache/kvlocks/cuda")
