#!/usr/bin/env bash
# Jobs longer than one command on the GPU machine: each runs in a process session of its own (the
# machine ends a command's other processes when the command returns), later commands wait for them,
# and each job's folder and log come back as one archive (at most 8 files return per command).
#
#   bash scripts/gpu/jobs.sh start NAME 'SHELL COMMAND'     # run by bash, "$JOB" in it: /tmp/kvlocks-jobs/NAME
#   bash scripts/gpu/jobs.sh wait OUT [SECONDS]            # until every job ended, or SECONDS (default 540);
#                                                          # then OUT/NAME.tgz for each job, and their states
#   bash scripts/gpu/jobs.sh status                        # each job: running, or its exit status
#
# A job inherits the starting command's environment (source /tmp/kvlocks-stage/env.sh first) and runs
# in the repository root. Call `wait` again, no more than 30 s after the previous command, while jobs run.
set -euo pipefail
ROOT=${KVLOCKS_JOBS_DIR:-/tmp/kvlocks-jobs}  # the jobs folder (a test sets another)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

usage() { sed -n '2,12p' "$0" >&2; exit 2; }

state() {  # NAME -> running | exit N
    if [[ -f "$ROOT/$1.rc" ]]; then echo "exit $(cat "$ROOT/$1.rc")"; else echo running; fi
}

jobs_known() { for f in "$ROOT"/*.pid; do [[ -e "$f" ]] && basename "$f" .pid; done; }

case "${1:-}" in
start)
    [[ $# -eq 3 ]] || usage
    name=$2; cmd=$3
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "jobs.sh: job name '$name': use letters, digits, _ . -" >&2; exit 2; }
    if [[ -f "$ROOT/$name.pid" && ! -f "$ROOT/$name.rc" ]]; then
        echo "jobs.sh: job '$name' is still running" >&2; exit 2
    fi
    mkdir -p "$ROOT/$name"
    rm -f "$ROOT/$name.rc"
    JOB="$ROOT/$name" setsid nohup bash -c 'cd "$1"; rc=0; bash -c "$2" || rc=$?; echo $rc > "$JOB.rc"' \
        jobs.sh "$REPO" "$cmd" > "$ROOT/$name.log" 2>&1 < /dev/null &
    echo $! > "$ROOT/$name.pid"
    echo "started $name (pid $!): $cmd"
    ;;
wait)
    [[ $# -ge 2 ]] || usage
    out=$2; limit=${3:-540}
    mkdir -p "$out"
    while (( SECONDS < limit )); do
        busy=0
        for name in $(jobs_known); do [[ "$(state "$name")" == running ]] && busy=1; done
        (( busy )) || break
        sleep 5
    done
    for name in $(jobs_known); do
        echo "== $name: $(state "$name") =="
        tail -n 3 "$ROOT/$name.log" || true
        files=("$name" "$name.log")
        [[ -f "$ROOT/$name.rc" ]] && files+=("$name.rc")
        rc=0
        tar czf "$out/$name.tgz" -C "$ROOT" "${files[@]}" 2> "$out/$name.tar.err" || rc=$?
        # tar's status 1: a running job's file changed while read; what was read is packed
        (( rc <= 1 )) || { cat "$out/$name.tar.err" >&2; echo "jobs.sh: packing $name failed ($rc)" >&2; }
        rm -f "$out/$name.tar.err"
    done
    ;;
status)
    for name in $(jobs_known); do echo "$name: $(state "$name")"; done
    ;;
*)
    usage
    ;;
esac
