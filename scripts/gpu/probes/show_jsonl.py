"""Print chosen fields of a probe's JSON-lines output, one row per line (a short summary in a device log).

    python3 scripts/gpu/probes/show_jsonl.py FILE FIELD [FIELD ...]

A missing field prints as ``-``; floats with 6 significant digits.
"""

from __future__ import annotations

import json
import sys


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return "-" if x is None else str(x)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    path, fields = sys.argv[1], sys.argv[2:]
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            print(" ".join(_fmt(row.get(k)) for k in fields))


if __name__ == "__main__":
    main()
