"""Run a grid of ``kvlocks eval`` jobs side by side on the device, resumable across calls.

One ``kvlocks eval`` process per line of a grid file (``scripts/gpu/grids/*.txt``: a job name,
then the eval's options), at most ``--parallel`` at once (the next starts when one ends), each
with one CPU thread: the HF decode path is bound by Python and kernel launches, so one process
leaves the GPU mostly idle and a dozen share it well; 20 at once ran an H100's 80 GB out of
memory (three SmolLM2 jobs stopped) and left each job a twentieth of the machine. A job that
exits with an error starts again, continuing from its rows, up to ``--retries`` times (default 1).
Each job writes ``STATE/<name>/`` (its ``rows.jsonl`` grows row by row, and ``kvlocks eval``
skips the rows it holds, so a job stopped at the time limit continues in the next call) and
``STATE/<name>.log``. At the end (or at ``--time-limit``) the whole state is packed into
``OUT/eval_state.tgz`` (one file: a GPU run returns at most 8) and each job's progress is
printed. A later call continues from ``STATE`` if the machine kept ``/tmp``, else from
``--resume`` (the previous call's tarball, carried back).

    python3 scripts/gpu/eval_grid.py --grid scripts/gpu/grids/quality.txt --out $OUT --time-limit 540 \
        [--resume .device/eval/eval_state.tgz] [--only gemma-,smollm2-8k]

Needs the staged models (``stage.py prepare model gemma``; this script sources the exports).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATE = Path("/tmp/kvlocks-eval")


def read_grid(path: Path) -> list[tuple[str, list[str]]]:
    """``(name, eval options)`` of each non-blank, non-comment line of a grid file."""
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *opts = shlex.split(line)
        if "--out" in opts:
            raise SystemExit(f"{path}:{n}: --out is set by this script (STATE/<name>)")
        jobs.append((name, opts))
    names = [j[0] for j in jobs]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: job names repeat")
    return jobs


def staged_env() -> dict:
    """The environment with the staging's exports (models, /tmp/site) and one thread a process."""
    script = "python3 scripts/gpu/stage.py env >/dev/null && . /tmp/kvlocks-stage/env.sh && env -0"
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def rows_of(state: Path, name: str) -> int:
    f = state / name / "rows.jsonl"
    return sum(1 for _ in f.open()) if f.exists() else 0


def tail(path: Path, n: int = 300) -> str:
    if not path.exists():
        return ""
    text = path.read_bytes()[-n:].decode(errors="replace").replace("\r", "\n")
    return " | ".join(s.strip() for s in text.splitlines() if s.strip())[-n:]


def run_jobs(jobs, launch, parallel: int, deadline: float, retries: int, poll_s: float = 2.0):
    """Run ``launch(name, opts) -> Popen`` for each job, at most ``parallel`` at once, until all
    ended or ``deadline`` (``time.monotonic``); a job that exits non-zero (a device out of memory
    beside other jobs, say) starts again, continuing from its rows, up to ``retries`` times.
    Returns ``(procs, tries)``: each job's last process (still running at the deadline: the caller
    stops it) and how many times it was started."""
    procs, tries, waiting = {}, {}, list(jobs)
    while time.monotonic() < deadline:
        for name, pr in list(procs.items()):
            if pr.poll() not in (None, 0) and tries[name] <= retries and name not in (j[0] for j in waiting):
                waiting.append((name, dict(jobs)[name]))  # its ended process stays in procs till then
        if not waiting and all(pr.poll() is not None for pr in procs.values()):
            break
        while waiting and sum(pr.poll() is None for pr in procs.values()) < parallel:
            name, opts = waiting.pop(0)
            tries[name] = tries.get(name, 0) + 1
            procs[name] = launch(name, opts)
        time.sleep(poll_s)
    return procs, tries


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="where eval_state.tgz goes (the device's $OUT)")
    p.add_argument("--state", type=Path, default=STATE)
    p.add_argument("--resume", type=Path, help="a previous call's eval_state.tgz, used when --state is absent")
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds until the jobs are stopped and packed")
    p.add_argument("--parallel", type=int, default=12, help="jobs running at once (default 12)")
    p.add_argument("--retries", type=int, default=1,
                   help="times a job that exits with an error is started again, continuing from its rows (default 1)")
    p.add_argument("--only", default="", help="comma-separated job names or name prefixes, e.g. gemma-,smollm2-8k (default: every job)")
    args = p.parse_args(argv)
    if args.parallel < 1:
        raise SystemExit(f"--parallel {args.parallel}: must be >= 1")
    if args.retries < 0:
        raise SystemExit(f"--retries {args.retries}: must be >= 0")
    t0 = time.monotonic()
    jobs = read_grid(args.grid)
    if args.only:
        prefixes = args.only.split(",")
        unmatched = [x for x in prefixes if not any(j[0].startswith(x) for j in jobs)]
        if unmatched:
            raise SystemExit(f"--only: {unmatched} match no job of {args.grid}")
        jobs = [j for j in jobs if any(j[0].startswith(x) for x in prefixes)]
    if not args.state.exists() and args.resume and args.resume.exists():
        with tarfile.open(args.resume) as tf:
            tf.extractall(args.state.parent, filter="data")
        print(f"resumed from {args.resume}", flush=True)
    args.state.mkdir(parents=True, exist_ok=True)
    env = staged_env()
    before = {name: rows_of(args.state, name) for name, _ in jobs}

    def launch(name, opts):
        cmd = [sys.executable, "-m", "kvlocks.cli", "eval", *opts, "--out", str(args.state / name)]
        log = open(args.state / f"{name}.log", "a")
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs, tries = run_jobs(jobs, launch, args.parallel, t0 + args.time_limit, args.retries)
    for pr in procs.values():
        if pr.poll() is None:
            pr.terminate()
    for pr in procs.values():
        try:
            pr.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pr.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out / "eval_state.tgz", "w:gz") as tf:
        # rows, reports and logs; not the saved ``full`` references (1 MB per answer token at
        # Gemma's vocabulary): a job resumed without them decodes ``full`` again for its open record
        tf.add(args.state, arcname=args.state.name,
               filter=lambda ti: None if ti.name.endswith(".pt") else ti)
    print(f"{'job':<28} {'rows':>6} {'new':>5}  exit  runs  last log", flush=True)
    for name, _ in jobs:
        n, pr = rows_of(args.state, name), procs.get(name)
        rc = "-" if pr is None else pr.returncode  # "-": not started (--parallel)
        print(f"{name:<28} {n:>6} {n - before[name]:>5}  {rc!s:>4}  {tries.get(name, 0):>4}  "
              f"{tail(args.state / f'{name}.log', 160)}")
    print(f"elapsed {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
