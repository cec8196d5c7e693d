"""``kvlocks fidelity``: the LOCKS chain of evidence measured on the model's own activations."""

from __future__ import annotations

from pathlib import Path

from kvlocks_lab import require_extras
from kvlocks_lab.commands import csv_of


def add_parser(sub) -> None:
    from kvlocks_lab.fidelity.config import FidelityConfig

    d = FidelityConfig.__dataclass_fields__
    p = sub.add_parser("fidelity", help="measure selector fidelity on captured activations (rows.jsonl, "
                                        "summary.json, PNG figures)")
    p.add_argument("--model", default=d["model"].default, help="bundled model name or local HF directory")
    p.add_argument("--budgets", type=csv_of(int), default=d["budgets"].default, help="comma-separated tokens")
    p.add_argument("--selectors", type=csv_of(str), default=(), help="comma-separated variants (default: all "
                   "of kvlocks_lab.fidelity.variants.DEFAULT_VARIANTS)")
    p.add_argument("--tasks", type=csv_of(str), default=d["tasks"].default, help="needle tasks")
    p.add_argument("--samples", type=int, default=d["samples"].default, help="records per task")
    p.add_argument("--text-records", type=int, default=d["text_records"].default, help="plain prose prompts")
    p.add_argument("--length", type=int, default=d["length"].default, help="prompt tokens")
    p.add_argument("--queries", type=int, default=d["queries"].default, help="query steps per prompt")
    p.add_argument("--layers", type=csv_of(int), default=(), help="layer indices (default: all)")
    p.add_argument("--kv-heads", type=csv_of(int), default=(), help="KV head indices (default: all)")
    p.add_argument("--rank", type=int, default=d["rank"].default)
    p.add_argument("--calib-tokens", type=int, default=d["calib_tokens"].default,
                   help="calibration prose for loki, global and locks_adapt*_calib; 0: none (long prompts can "
                        "use up the prose that is disjoint from them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--captures", type=Path, default=None,
                   help="keep (and reuse) the safetensors captures in this directory (default: a temporary one)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=run)


def run(args) -> int:
    require_extras()
    from kvlocks_lab.fidelity import FidelityConfig, run_fidelity

    cfg = FidelityConfig(model=args.model, budgets=args.budgets, selectors=args.selectors, tasks=args.tasks,
                         samples=args.samples, text_records=args.text_records, length=args.length,
                         queries=args.queries, layers=args.layers, kv_heads=args.kv_heads, rank=args.rank,
                         calib_tokens=args.calib_tokens, seed=args.seed, dtype=args.dtype, device=args.device)
    print(f"loading {cfg.model} ...", flush=True)
    summary = run_fidelity(cfg, args.out, captures=args.captures)
    sel = summary["selectors"]
    print(f"\n{'selector':<18}{'budget':>7}{'coverage':>10}{'carrier':>9}{'LSE MAE':>9}{'Spearman':>9}")
    for name, entry in sel.items():
        for b, cell in entry["budgets"].items():
            vals = [cell["coverage"], cell["carrier"], cell["lse_mae"], cell["spearman"]]
            print(f"{name:<18}{b:>7}" + "".join(" " * 3 + ("     -" if v is None else f"{v:6.3f}") for v in vals))
    print(f"\nwrote {args.out / 'rows.jsonl'}, {args.out / 'summary.json'} and PNG figures "
          f"in {summary['timings']['total_s']:.0f} s")
    return 0
