"""Compile a CUDA source shipped with kvlocks into a shared library with nvcc, once, and load it.

The library is cached under ``$KVLOCKS_CACHE`` (default ``~/.cache/kvlocks``) in ``cuda/``, named
by a hash of the source, the flags, the nvcc version and the GPU architecture, so an edited source
or another GPU compiles afresh. nvcc is ``$KVLOCKS_NVCC``, else the one on ``PATH``, else
``$CUDA_HOME/bin/nvcc`` or ``/usr/local/cuda/bin/nvcc``. The CUDA runtime is linked statically
(nvcc's default), so the library needs only the driver that torch already uses.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from kvlocks import env

FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class NvccUnavailable(RuntimeError):
    """No nvcc, or the source did not compile: the caller falls back to another kernel."""


def find_nvcc() -> str | None:
    chosen = env.get("KVLOCKS_NVCC")
    if chosen:
        return chosen
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    return Path(env.get("KVLOCKS_CACHE")).expanduser() / "cuda"


@lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise NvccUnavailable(f"{nvcc} --version failed: {exc}") from exc


def compile_library(source: Path, arch: str) -> Path:
    """``source`` (a .cu file) -> path of the compiled ``.so`` for ``arch`` (e.g. ``"sm_90"``)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise NvccUnavailable("nvcc not found: set KVLOCKS_NVCC or CUDA_HOME, or put nvcc on PATH")
    text = source.read_bytes()
    key = hashlib.sha256(text + repr((FLAGS, arch)).encode() + _nvcc_version(nvcc).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{arch}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [nvcc, *FLAGS, f"-arch={arch}", str(source), "-o", str(tmp_out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise NvccUnavailable(f"nvcc failed on {source.name} ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent compile of the same key writes the same bytes
    return out


@lru_cache(maxsize=None)
def load_library(source: str, arch: str) -> ctypes.CDLL:
    """Compile (if not cached) and load; raises :class:`NvccUnavailable` when that is impossible."""
    return ctypes.CDLL(str(compile_library(Path(source), arch)))


@lru_cache(maxsize=None)
def _arch_of(index: int) -> str:
    import torch  # noqa: PLC0415 (this module needs no torch to compile)

    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


class CudaSource:
    """One shipped ``.cu`` file: compiled per GPU architecture at first use, loaded with ctypes, its
    argument types declared by ``declare(lib)``; where that is impossible (not a CUDA device, no
    nvcc, a compile error) :meth:`available` is False, with the reason in :meth:`unavailable_reason`,
    and one RuntimeWarning naming ``fallback`` (what runs instead)."""

    def __init__(self, source: Path, what: str, fallback: str, declare) -> None:
        self.source, self.what, self.fallback, self._declare = Path(source), what, fallback, declare
        self._state: dict[str, str | None] = {}

    @staticmethod
    def arch(device) -> str:
        """``sm_XY`` of a CUDA device (cached)."""
        import torch  # noqa: PLC0415

        device = torch.device(device)
        return _arch_of(device.index if device.index is not None else torch.cuda.current_device())

    def library(self, device) -> ctypes.CDLL:
        lib = load_library(str(self.source), self.arch(device))
        if not hasattr(lib, "_kvlocks_typed"):
            self._declare(lib)
            lib.kvlocks_error_string.argtypes = [ctypes.c_int]
            lib.kvlocks_error_string.restype = ctypes.c_char_p
            lib._kvlocks_typed = True
        return lib

    def available(self, device) -> bool:
        """Whether the library is compiled and loadable for this CUDA device (compiles it on first call)."""
        import torch  # noqa: PLC0415

        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        key = self.arch(device)
        if key not in self._state:
            try:
                self.library(device)
                self._state[key] = None
            except (NvccUnavailable, OSError) as exc:
                self._state[key] = str(exc)
                import warnings  # noqa: PLC0415

                warnings.warn(f"{self.what} unavailable, {self.fallback} instead: {exc}", RuntimeWarning, stacklevel=3)
        return self._state[key] is None

    def unavailable_reason(self, device) -> str | None:
        """Why :meth:`available` is False (not a CUDA device, nvcc missing, compile error), else None."""
        import torch  # noqa: PLC0415

        if self.available(device):
            return None
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            return "not a CUDA device"
        return self._state[self.arch(device)]

    def error(self, device, code: int) -> str:
        return self.library(device).kvlocks_error_string(code).decode()
