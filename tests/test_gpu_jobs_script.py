"""scripts/gpu/jobs.sh: jobs outlive the command that started them, `wait` returns when they end (or
at its limit) with each job's folder, log and exit status packed into one archive."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "jobs.sh"


def _jobs(tmp_path, *args, check=True):
    env = {**os.environ, "KVLOCKS_JOBS_DIR": str(tmp_path / "jobs")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=check,
                          timeout=60)


def test_jobs_run_detached_and_come_back_packed(tmp_path):
    _jobs(tmp_path, "start", "ok", 'sleep 1; pwd > "$JOB/where"; echo done')
    _jobs(tmp_path, "start", "fails", "echo broken >&2; exit 3")
    _jobs(tmp_path, "start", "slow", "sleep 30")
    _jobs(tmp_path, "start", "busy", 'for i in $(seq 1 100000); do echo $i >> "$JOB/grows"; done; sleep 30')
    t0 = time.time()
    res = _jobs(tmp_path, "wait", str(tmp_path / "out"), "4")
    assert time.time() - t0 < 15  # stops at its limit while "slow" runs
    assert "== ok: exit 0 ==" in res.stdout and "== fails: exit 3 ==" in res.stdout
    assert "== slow: running ==" in res.stdout
    with tarfile.open(tmp_path / "out" / "ok.tgz") as t:
        names = set(t.getnames())
        assert {"ok/where", "ok.log", "ok.rc"} <= names
        assert t.extractfile("ok/where").read().decode().strip() == str(SCRIPT.parents[2])  # the repository root
        assert t.extractfile("ok.log").read().decode().strip() == "done"
    with tarfile.open(tmp_path / "out" / "fails.tgz") as t:
        assert t.extractfile("fails.rc").read().decode().strip() == "3"
        assert "broken" in t.extractfile("fails.log").read().decode()
    with tarfile.open(tmp_path / "out" / "slow.tgz") as t:
        assert "slow.rc" not in t.getnames()
    with tarfile.open(tmp_path / "out" / "busy.tgz") as t:  # packed while its file grew
        assert "busy/grows" in t.getnames()
    assert "slow: running" in _jobs(tmp_path, "status").stdout
    again = _jobs(tmp_path, "start", "slow", "true", check=False)
    assert again.returncode == 2 and "still running" in again.stderr
    for name in ("slow", "busy"):
        os.killpg(int((tmp_path / "jobs" / f"{name}.pid").read_text()), 9)


def test_bad_job_names_and_missing_arguments_are_refused(tmp_path):
    bad = _jobs(tmp_path, "start", "a/b", "true", check=False)
    assert bad.returncode == 2 and "job name 'a/b'" in bad.stderr
    assert _jobs(tmp_path, "start", "two", "sleep", "1", check=False).returncode == 2  # one command string
    assert _jobs(tmp_path, "wait", check=False).returncode == 2
    assert _jobs(tmp_path, "frobnicate", check=False).returncode == 2
