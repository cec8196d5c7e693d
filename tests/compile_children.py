"""The child processes of the sm_90 compile checks (``tests/test_triton_compile.py``,
``tests/test_triton_compile_d256.py``).

A module compiles its kernels in a child process without the Triton interpreter, once with the
venv's Triton and once with the GPU image's (``.venv/triton-device``, ``scripts/setup_device_triton.sh``).
Compiling takes minutes on one core, so the first of a module's two tests starts both children and
each test waits for its own: on two cores they compile side by side. Under pytest-xdist (the GPU
runs) each test starts only its own, as each runs on its own worker.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_TRITON = ROOT / ".venv" / "triton-device"


class Children:
    """``script`` run as ``python script`` with the environment ``env_for(extra_path)`` gives (None: the
    venv's Triton; ``str(DEVICE_TRITON)``: the GPU image's), at most once per path."""

    def __init__(self, script: str, env_for, timeout: int) -> None:
        self.script, self.env_for, self.timeout = script, env_for, timeout
        self.procs: dict = {}
        atexit.register(self._kill)

    def _start(self, extra_path: str | None) -> subprocess.Popen:
        if extra_path not in self.procs:
            self.procs[extra_path] = subprocess.Popen([sys.executable, self.script], env=self.env_for(extra_path),
                                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self.procs[extra_path]

    def output(self, extra_path: str | None = None) -> str:
        """The child's stdout, after asserting it exited 0 having printed ``compiled``."""
        if "PYTEST_XDIST_WORKER" not in os.environ:
            self._start(None)
            if (DEVICE_TRITON / "triton").is_dir():
                self._start(str(DEVICE_TRITON))
        proc = self._start(extra_path)
        out, err = proc.communicate(timeout=self.timeout)
        assert proc.returncode == 0 and "compiled" in out, out[-3000:] + err[-3000:]
        return out

    def _kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
