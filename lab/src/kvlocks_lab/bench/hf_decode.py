"""Per-step decode time of the Hugging Face path for each LOCKS mode (CUDA, the decode plan's kernels).

``python -m kvlocks_lab.bench.hf_decode --out DIR [--lengths 2048,4096,7936] [--budget 256]
[--methods full,locks,locks_rerank,locks_centroid] [--dtype bfloat16] [--steps 48]``

Per length L, random token ids of length L are prefilled once into a ``locks`` cache; every method
decodes from a fork of it through :func:`kvlocks.integrations.hf.decode.step` (what the evaluation
runs), the methods taking turns step by step so that clock and load changes fall on all of them
alike. A step is timed with ``torch.cuda.synchronize`` on both sides (host time, the whole model
step: 30 layers of the bundled model). ``ms_per_step`` is the median step; ``ratio_to_locks`` the
method's median over ``locks``'s (the check: ``locks_rerank`` at most 1.3x ``locks``).

Writes ``rows.jsonl`` (one row per length x method, with every step's time and the byte
accounting) and ``summary.json`` (config, commit, device, versions, the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks.integrations.hf import LocksCache
from kvlocks.integrations.hf.decode import prefill, step

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class HfDecodeConfig:
    model: str = "smollm2-135m"
    lengths: tuple[int, ...] = (2048, 4096, 7936)
    methods: tuple[str, ...] = ("full", "locks", "locks_rerank", "locks_centroid")
    budget: int = 256
    dtype: str = "bfloat16"
    steps: int = 48
    warmup: int = 8
    device: str = "cuda"

    def __post_init__(self) -> None:
        from kvlocks.integrations.hf import method_names

        for m in self.methods:
            if m not in method_names():
                raise ValueError(f"HfDecodeConfig.methods: {m!r}; allowed {method_names()}")
        if self.dtype not in DTYPES:
            raise ValueError(f"HfDecodeConfig.dtype={self.dtype!r}: allowed {tuple(DTYPES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"HfDecodeConfig: steps={self.steps} must be >= 1, warmup={self.warmup} >= 0")
        LocksConfig(budget=self.budget)  # validates the budget


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_length(model, cfg: HfDecodeConfig, n: int) -> list[dict]:
    """One row per method at ``n`` prompt tokens (the decoded tokens included in the positions)."""
    dev = model.device
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(dev)
    base = LocksConfig(budget=cfg.budget)
    shared = LocksCache(model.config, method="locks", config=base)
    logits = prefill(model, shared, ids)
    caches = {m: shared.fork(method=m, config=method_config(m, base)) for m in cfg.methods}
    tokens = {m: int(logits.argmax()) for m in cfg.methods}
    times: dict[str, list[float]] = {m: [] for m in cfg.methods}
    for i in range(cfg.warmup + cfg.steps):
        for m in cfg.methods:  # the methods take turns, step by step
            _sync(dev)
            t0 = time.perf_counter()
            out = step(model, caches[m], tokens[m])
            _sync(dev)
            if i >= cfg.warmup:
                times[m].append(1000 * (time.perf_counter() - t0))
            tokens[m] = int(out.argmax())
    rows = []
    locks_ms = statistics.median(times["locks"]) if "locks" in times else None
    for m in cfg.methods:
        ms = statistics.median(times[m])
        rows.append({"length": n, "method": m, "budget": cfg.budget, "config": json.loads(caches[m].config.to_json()),
                     "backend": caches[m].plan_backend(caches[m].layers[0].store.keys) if m != "full" else None,
                     "ms_per_step": ms, "ratio_to_locks": None if locks_ms is None else ms / locks_ms,
                     "step_ms": times[m], "stats": caches[m].stats.summary()})
    return rows


def run(cfg: HfDecodeConfig, out: Path, *, model=None) -> dict:
    """Measure every length; write rows.jsonl and summary.json."""
    from kvlocks_lab.eval.report import _versions, git_commit

    if model is None:
        from kvlocks.models import load

        model, _ = load(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (out / "rows.jsonl").open("w") as fh:
        for n in cfg.lengths:
            for r in measure_length(model, cfg, n):
                fh.write(json.dumps(r) + "\n")
                rows.append(r)
    table = [{k: r[k] for k in ("length", "method", "backend", "ms_per_step", "ratio_to_locks")}
             | {"read_fraction": r["stats"].get("read_fraction")} for r in rows]
    dev = torch.device(cfg.device)
    summary = {"config": asdict(cfg), "commit": git_commit(), "versions": _versions(),
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "rerank_at_most_1_3x_locks": all(r["ratio_to_locks"] <= 1.3 for r in table
                                                if r["method"] == "locks_rerank" and r["ratio_to_locks"] is not None),
               "results": table}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlocks_lab.bench.hf_decode", description=__doc__.split("\n\n")[0])
    d = HfDecodeConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--lengths", default=",".join(map(str, d.lengths)))
    p.add_argument("--methods", default=",".join(d.methods))
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--dtype", default=d.dtype, choices=tuple(DTYPES))
    p.add_argument("--steps", type=int, default=d.steps, help="timed decode steps per method and length")
    p.add_argument("--device", default=d.device)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cfg = HfDecodeConfig(model=args.model, lengths=tuple(int(x) for x in args.lengths.split(",")),
                         methods=tuple(args.methods.split(",")), budget=args.budget, dtype=args.dtype,
                         steps=args.steps, device=args.device)
    summary = run(cfg, args.out)
    for r in summary["results"]:
        ratio = "" if r["ratio_to_locks"] is None else f"  {r['ratio_to_locks']:.2f}x locks"
        print(f"{r['length']:>6} {r['method']:>15}: {r['ms_per_step']:8.2f} ms/step{ratio}  ({r['backend']})")
    print(f"locks_rerank <= 1.3x locks: {summary['rerank_at_most_1_3x_locks']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
