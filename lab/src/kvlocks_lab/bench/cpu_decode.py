"""Decode-step time of full attention and LOCKS on the CPU, through the Hugging Face path.

``python -m kvlocks_lab.bench.cpu_decode --out DIR [--lengths 4096,8192] [--budget 256]``

Per length L, one passkey record of L minus the decoded tokens is prefilled once; every method decodes from a fork of that cache
through :func:`kvlocks.integrations.hf.decode.step` (the eval runner's step), the methods taking
turns step by step so that load from other processes falls on all of them alike. Methods:
``full``, a selector name (``locks``, ``oracle``: the default CPU path) and ``NAME_ref`` (the same
selector on ``backend="torch"``, the pure-PyTorch references). Times are summed over blocks of
``page_size`` steps (each block holds one page fill, so the summary builds are in), and
``ms_per_step`` is the median block's sum divided by ``page_size``.

Where the time goes: per method, the top operators of one block by self CPU time
(``torch.profiler``), and per layer, the parts of one attention call timed alone on layer 0's
cache (:mod:`kvlocks_lab.bench.cpu_parts`).

Writes ``rows.jsonl`` (one row per length x method, with every step's time), ``summary.json``
(config, commit, machine, versions, ms per step and the ratio to ``full``) and ``step_ms.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlocks.config import LocksConfig, method_config
from kvlocks.integrations.hf import LocksCache
from kvlocks.integrations.hf.decode import prefill, step


@dataclass(frozen=True, kw_only=True)
class CpuDecodeConfig:
    model: str = "smollm2-135m"
    lengths: tuple[int, ...] = (4096, 8192)
    methods: tuple[str, ...] = ("full", "locks", "locks_ref")
    budget: int = 256
    blocks: int = 4
    warmup: int = 4
    top_ops: int = 12

    def __post_init__(self) -> None:
        from kvlocks.integrations.hf import method_names

        for m in self.methods:
            if m.removesuffix("_ref") not in method_names() or m == "full_ref":
                raise ValueError(f"CpuDecodeConfig.methods: {m!r}; allowed {method_names()} and NAME_ref "
                                 "for a selector on the references")
        if self.blocks < 1 or self.warmup < 0:
            raise ValueError(f"CpuDecodeConfig: blocks={self.blocks} must be >= 1, warmup={self.warmup} >= 0")
        LocksConfig(budget=self.budget)  # validates the budget


def open_method(shared: LocksCache, name: str, config: LocksConfig) -> LocksCache:
    """A fork of ``shared`` for ``name``: ``full``, a selector, or ``NAME_ref`` (references)."""
    fork = shared.fork(method=name.removesuffix("_ref"), config=method_config(name.removesuffix("_ref"), config))
    if name.endswith("_ref"):
        fork.backend = "torch"
        for layer in fork.layers:  # its own summaries object: the references cache dequantized
            s = layer.store.summaries  # views in it, which the other forks would otherwise carry
            if s is not None:
                layer.store.summaries = s.select_pages(slice(0, s.num_pages))
    return fork


def _top_ops(run, n: int, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / steps,
             "calls_per_step": e.count / steps} for e in rows]


@torch.inference_mode()
def measure_length(model, tok, cfg: CpuDecodeConfig, length: int) -> list[dict]:
    """One row per method at ``length`` prompt tokens (see the module doc)."""
    from kvlocks_lab.bench.cpu_parts import layer_parts
    from kvlocks_lab.eval.tasks import generate

    config = LocksConfig(budget=cfg.budget)
    s = config.page_size
    n_steps = cfg.warmup + cfg.blocks * s
    # every decoded token (timed steps, then one profiled block) stays within ``length`` positions
    record = generate("passkey", tok, length - n_steps - s, 1)[0]
    shared = LocksCache(model.config, method="locks", config=config)
    t0 = time.perf_counter()
    prefill(model, shared, torch.tensor([record.context_ids], device=model.device))
    prefill_s = time.perf_counter() - t0
    caches = {m: open_method(shared, m, config) for m in cfg.methods}
    feed = (record.context_ids[-n_steps:] * 2)[:n_steps]
    times = {m: [] for m in caches}
    for i, t in enumerate(feed):
        for m, cache in caches.items():
            t1 = time.perf_counter()
            step(model, cache, t)
            if i >= cfg.warmup:
                times[m].append(1000 * (time.perf_counter() - t1))
    rows = []
    for m, cache in caches.items():
        blocks = [sum(times[m][j * s : (j + 1) * s]) for j in range(cfg.blocks)]
        more = feed[:s]
        ops = _top_ops(lambda: [step(model, cache, t) for t in more], cfg.top_ops, s)
        rows.append({
            "length": length, "method": m, "budget": None if m == "full" else cfg.budget,
            "context_tokens": len(record.context_ids), "prefill_s": prefill_s,
            "ms_per_step": statistics.median(blocks) / s, "block_ms": blocks,
            "step_ms_median": statistics.median(times[m]), "step_ms": times[m],
            "stats": cache.stats.summary(), "top_ops": ops,
            "layer_parts": layer_parts(model, cache, m),
        })
    base = next((r["ms_per_step"] for r in rows if r["method"] == "full"), None)
    for r in rows:
        r["ratio_to_full"] = None if base is None else r["ms_per_step"] / base
    return rows


def _machine() -> dict:
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "platform": platform.platform()}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ys = [next((r["ms_per_step"] for r in rows if r["method"] == m and r["length"] == n), 0) for n in lengths]
        ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: CpuDecodeConfig, out: Path, *, model=None, tok=None, plot: bool = True) -> dict:
    """Measure every length; write rows.jsonl, summary.json and (``plot``) step_ms.png."""
    from kvlocks_lab.eval.report import _versions, git_commit

    if model is None:
        from kvlocks.models import load

        model, tok = load(cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (out / "rows.jsonl").open("w") as fh:
        for n in cfg.lengths:
            for r in measure_length(model, tok, cfg, n):
                fh.write(json.dumps(r) + "\n")
                rows.append(r)
    table = [{k: r[k] for k in ("length", "method", "budget", "ms_per_step", "ratio_to_full", "step_ms_median")}
             | {"read_fraction": r["stats"].get("read_fraction")} for r in rows]
    summary = {"config": asdict(cfg), "commit": git_commit(), "machine": _machine(), "versions": _versions(),
               "dtype": str(model.dtype), "results": table}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if plot:
        _plot(rows, out / "step_ms.png")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlocks_lab.bench.cpu_decode", description=__doc__.split("\n\n")[0])
    d = CpuDecodeConfig()
    p.add_argument("--model", default=d.model)
    p.add_argument("--lengths", default=",".join(map(str, d.lengths)))
    p.add_argument("--methods", default=",".join(d.methods))
    p.add_argument("--budget", type=int, default=d.budget)
    p.add_argument("--blocks", type=int, default=d.blocks, help="blocks of page_size timed steps per method")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    cfg = CpuDecodeConfig(model=args.model, lengths=tuple(int(x) for x in args.lengths.split(",")),
                          methods=tuple(args.methods.split(",")), budget=args.budget, blocks=args.blocks)
    summary = run(cfg, args.out)
    for r in summary["results"]:
        ratio = "" if r["ratio_to_full"] is None else f"  {r['ratio_to_full']:.2f}x full"
        print(f"{r['length']:>6} {r['method']:>10}: {r['ms_per_step']:7.1f} ms/step{ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
