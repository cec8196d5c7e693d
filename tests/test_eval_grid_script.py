"""scripts/gpu/eval_grid.py's scheduling with stand-in jobs: at most --parallel at once, a job that
fails started again up to --retries times, the deadline respected."""

from __future__ import annotations

import subprocess
import sys
import time

from script_module import load_script


def _module():
    return load_script("gpu/eval_grid.py", "eval_grid_script")


def test_failed_jobs_start_again_up_to_the_retries(tmp_path):
    m = _module()
    # "ok" succeeds; "flaky" fails at its first start only (a marker file); "bad" always fails
    code = {"ok": "0", "flaky": f"0 if __import__('os').path.exists({str(tmp_path / 'ran')!r}) else "
                               f"(open({str(tmp_path / 'ran')!r}, 'w'), 3)[1]", "bad": "2"}
    running, peak = [], []

    def launch(name, opts):
        pr = subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep(0.3); sys.exit({code[name]})"])
        running.append(pr)
        peak.append(sum(p.poll() is None for p in running))
        return pr

    jobs = [("ok", []), ("flaky", []), ("bad", [])]
    procs, tries = m.run_jobs(jobs, launch, parallel=2, deadline=time.monotonic() + 60, retries=1, poll_s=0.05)
    assert {n: p.returncode for n, p in procs.items()} == {"ok": 0, "flaky": 0, "bad": 2}
    assert tries == {"ok": 1, "flaky": 2, "bad": 2} and max(peak) <= 2
    procs, tries = m.run_jobs([("bad", [])], launch, parallel=2, deadline=time.monotonic() + 60, retries=0,
                              poll_s=0.05)
    assert tries == {"bad": 1} and procs["bad"].returncode == 2


def test_the_deadline_leaves_running_jobs_to_the_caller():
    m = _module()
    slow = []

    def launch(name, opts):
        slow.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))
        return slow[-1]

    t0 = time.monotonic()
    procs, tries = m.run_jobs([("a", []), ("b", [])], launch, parallel=1, deadline=t0 + 0.5, retries=1, poll_s=0.05)
    try:
        assert time.monotonic() - t0 < 5 and tries == {"a": 1} and procs["a"].poll() is None  # b never started
    finally:
        for pr in slow:
            pr.kill()
