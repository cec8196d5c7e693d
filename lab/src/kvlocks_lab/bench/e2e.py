"""End-to-end decode benchmark behind ``kvlocks bench e2e --out DIR``: whole models, dense vs LOCKS.

Random-weight models at real shapes (``kvlocks.engine.models.SHAPES``: GLM-4-9B-Chat-1M,
Llama-3.1-8B), built on the GPU in bf16. Per (model, context, batch): a static paged cache sized
for the case (skipped, with the reason, when free memory does not allow it), filled by a real
dense prefill up to ``max_prefill`` tokens (timed: ``ttft_ms``, the median of ``ttft_repeats``
prefills, dense and LOCKS's (the same prefill with the summary build on a side stream)
alternating, each first in turn, so neither gains from running second) and by random K/V above
it (a 9B-model prefill at 1M tokens takes many minutes), then the summary build of every full page of
every layer (``build_ms``), then per method the decode step of :mod:`kvlocks.engine` captured in
CUDA graphs: ``tpot_ms`` is the median of ``steps`` replays, each timed with CUDA events after
``warmup`` replays, ``tpot_mean_ms`` their mean and ``tpot_max_ms`` the slowest (for LOCKS, a step
that fills a page also builds its summary in every layer: one step in 16 when ``steps`` >= 16). ``floor_ms`` is the step's bytes (weights + summaries + selected K/V for
LOCKS; weights + all K/V for dense) over the device-to-device copy bandwidth measured in the same
run (read + write bytes, as in the kernel benchmark).

Writes ``DIR/summary.json`` (config, device, versions, copy bandwidth, rows, errors) after every
case and ``DIR/rows.jsonl`` (one record per row, appended), so a timeout keeps what finished.
On the CPU (backend torch, no graph, wall-clock timing) it runs for schema tests only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from kvlocks import env
from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.engine.attention import DENSE_KERNEL, DENSE_REFERENCE
from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.graph import StepRunner
from kvlocks.engine.overlap import PrefillBuild
from kvlocks.engine.models import model_config, random_model
from kvlocks.engine.parts import model_parts
from kvlocks.engine.prefill import prefill, prefill_bytes
from kvlocks.engine.step import COMPILE_MODE, DecodeStep
from kvlocks.plan import resolve_backend
from kvlocks_lab.bench.e2e_config import DTYPES, ROW_KEYS, E2EBenchConfig
from kvlocks_lab.bench.e2e_timing import (  # noqa: F401 (copy_bandwidth, step_bytes, _time_steps: probes)
    _elapsed_s, _free, _now, _quantile, _sync, _time_steps, copy_bandwidth, step_bytes,
)

log = logging.getLogger(__name__)

class _Case:
    """One (model, context, batch): allocate, fill (prefill or random), build, then time methods."""

    def __init__(self, bench, parts, name, n, bsz):
        self.b, self.parts, self.name, self.n, self.bsz = bench, parts, name, n, bsz
        cfg = bench.cfg
        self.capacity = n + cfg.steps + cfg.warmup + 16  # every method restarts at n; graph warm-up is undone
        self.lcfg = LocksConfig(budget=cfg.budget)
        self.configs = {"locks": self.lcfg, "locks_centroid": cfg.centroid_config(self.lcfg)}
        self.real_prefill = n * bsz <= cfg.max_prefill
        self.overlap: dict = {}  # the LOCKS prefill's fields (real prefills only)

    def memory_check(self) -> str | None:
        """Why the case cannot run (a string), or None."""
        p, dev = self.parts, self.b.device
        need = StaticPagedCache.nbytes(layers=p.num_layers, batch=self.bsz, num_kv_heads=p.num_kv_heads,
                                       head_dim=p.head_dim, max_context=self.capacity, config=self.lcfg,
                                       dtype=p.dtype)["total"]
        if self.real_prefill:
            inter = p.layers[0].mlp.down_proj.in_features
            need += prefill_bytes(p, self.bsz, self.n, self.b.cfg.prefill_chunk, inter)
        need += int(self.b.cfg.reserve_gib * 2**30)
        if dev.type != "cuda":
            return None
        free = torch.cuda.mem_get_info(dev)[0]
        if need > free:
            return f"skipped: needs {need / 2**30:.1f} GiB (cache + activations + reserve), {free / 2**30:.1f} GiB free"
        return None

    def prepare(self) -> dict:
        """Allocate the cache, fill it, build summaries; returns the shared row fields."""
        p, cfg, dev = self.parts, self.b.cfg, self.b.device
        self.cache = StaticPagedCache(layers=p.num_layers, batch=self.bsz, num_kv_heads=p.num_kv_heads,
                                      head_dim=p.head_dim, max_context=self.capacity, config=self.lcfg,
                                      dtype=p.dtype, device=dev)
        gen = torch.Generator(device=dev).manual_seed(cfg.seed)
        out = {"ttft_ms": None, "fill": "random"}
        if self.real_prefill:
            vocab = p.embed.weight.shape[0]
            ids = torch.randint(0, vocab, (self.bsz, self.n), generator=gen, device=dev)
            if not self.b.prefill_warm:  # first prefill of this model: kernels, cuBLAS handles
                prefill(p, self.cache, ids[:, : min(self.n, 1024)], chunk=cfg.prefill_chunk)
                self.b.prefill_warm = True
            dense_ms, overlapped = [], []
            for r in range(cfg.ttft_repeats):  # alternate which prefill runs first: no order effect
                for which in ("dense", "locks") if r % 2 == 0 else ("locks", "dense"):
                    if which == "dense":
                        _sync(dev)
                        t0 = _now(dev)
                        logits = prefill(p, self.cache, ids, chunk=cfg.prefill_chunk)
                        dense_ms.append(_elapsed_s(dev, t0) * 1e3)
                    elif any(m != "dense" for m in cfg.methods):
                        if not overlapped:  # untimed, after the first dense prefill filled the cache
                            self.cache.build(backend=self.b.backend, layers=range(1),
                                             options=cfg.kernels)  # compiles / autotunes
                        overlapped.append(self._overlapped_prefill(ids))
            runs = len(dense_ms)
            out.update(fill="prefill", ttft_ms=statistics.median(dense_ms), ttft_runs_ms=dense_ms,
                       ttft_note=f"real dense prefill of {self.n} tokens x batch {self.bsz}, median of {runs} "
                                 f"runs alternating with LOCKS's")
            self.first = logits.argmax(dim=-1)
            if overlapped:
                ttft = [o[0] for o in overlapped]
                ready = statistics.median(o[1] for o in overlapped)
                self.overlap = {
                    "ttft_ms": statistics.median(ttft), "ttft_runs_ms": ttft, "ready_ms": ready,
                    "build_exposed_ms": ready - out["ttft_ms"],
                    "ttft_note": f"real dense prefill of {self.n} tokens x batch {self.bsz}, summaries built during "
                                 f"it ({overlapped[0][2]}), median of {runs} runs alternating with dense's"}
        else:
            self.cache.random_fill(self.n, generator=gen)
            out["ttft_note"] = (f"null: no real prefill above max_prefill={cfg.max_prefill} tokens per case "
                                f"(random K/V fill)")
            self.first = torch.ones(self.bsz, dtype=torch.long, device=dev)
        self.build_ms = None
        if any(m != "dense" for m in cfg.methods):
            self.cache.build(backend=self.b.backend, layers=range(1), options=cfg.kernels)  # untimed: compiles
            _sync(dev)
            t0 = _now(dev)
            self.cache.build(backend=self.b.backend, options=cfg.kernels)
            self.build_ms = _elapsed_s(dev, t0) * 1e3
        return out

    def _overlapped_prefill(self, ids: torch.Tensor) -> tuple[float, float, str]:
        """The LOCKS engine's prefill: the same dense prefill with every layer's summary build
        queued behind it on a side stream (:class:`PrefillBuild`). Returns (ms to the first token,
        ms until the summaries are complete, how they were built)."""
        p, cfg, dev = self.parts, self.b.cfg, self.b.device
        build = PrefillBuild(self.cache, self.n, backend=self.b.backend, options=cfg.kernels)
        _sync(dev)
        t0 = _now(dev)
        with build.prefill_stream():
            prefill(p, self.cache, ids, chunk=cfg.prefill_chunk, after_layer=build)
        t1 = _now(dev)
        build.finish()
        ready = _elapsed_s(dev, t0) * 1e3
        ttft = (t0.elapsed_time(t1) if dev.type == "cuda" else (t1 - t0) * 1e3)
        return ttft, ready, "side stream" if build.overlapped else "inline"

    def measure(self, method: str) -> dict:
        cfg, dev = self.b.cfg, self.b.device
        self.cache.set_length(self.n)
        sparse = method != "dense"
        self.cache.config = self.configs.get(method, self.lcfg)  # the plan's selection (same summaries)
        step = DecodeStep(self.parts, self.cache, method="locks" if sparse else method, backend=self.b.backend,
                          compile=cfg.compile, options=cfg.kernels)
        self.cache.config = self.lcfg
        step.tokens.copy_(self.first)
        step.attn.tune()  # the attention kernel's fastest launch for this cache (before the graph)
        runner = StepRunner(step, use_graph=self.b.use_graph)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times = _time_steps(runner, dev, cfg.steps, cfg.warmup)
        tpot = statistics.median(times)
        tuned = step.attn.tuned  # both attention classes: None until tune() ran on CUDA
        row = {"method": method, "kernel": step.attn.kernel, "compiled": cfg.compile,
               "compile_mode": step.compile_mode, "tpot_ms": tpot,
               "attention_launch_us": tuned.times_us if tuned else None,
               "tpot_mean_ms": statistics.fmean(times), "tpot_max_ms": max(times), "steps": cfg.steps,
               "tpot_p10_ms": _quantile(times, 0.1), "tpot_p90_ms": _quantile(times, 0.9),
               "budget": cfg.budget if sparse else None,
               "rerank_scores": step.attn.plan.config.rerank_scores if sparse else None,
               "build_ms": self.build_ms if sparse else None,
               **(self.overlap if sparse else {}),
               **step_bytes(self.parts, self.cache, method, self.n, self.configs.get(method))}
        if dev.type == "cuda":
            row["gpu_mem_gb"] = torch.cuda.memory_allocated(dev) / 1e9
            row["gpu_peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        bw = self.b.copy_gbps
        row["floor_ms"] = row["bytes_per_step"] / (bw * 1e9) * 1e3 if bw else None
        row["tpot_over_floor"] = tpot / row["floor_ms"] if row["floor_ms"] else None
        del runner, step
        return row


class E2EBench:
    """State of one benchmark run: device, copy bandwidth, rows, errors, output files."""

    def __init__(self, out_dir, cfg: E2EBenchConfig, device, progress):
        self.cfg, self.device, self.progress = cfg, device, progress or (lambda msg: None)
        self.backend = resolve_backend(None, device)
        self.use_graph = device.type == "cuda"
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "rows.jsonl").write_text("")
        self.rows, self.errors = [], []
        self.copy_gbps = copy_bandwidth(device)
        self.progress(f"copy bandwidth {self.copy_gbps:.0f} GB/s (read + write) on {_device_name(device)}")
        self.prefill_warm = False

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        with (self.out / "rows.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        floor = f", floor {row['floor_ms']:.2f} ms" if row.get("floor_ms") else ""
        extra = f", {row['speedup_vs_dense']:.2f}x vs dense" if row.get("speedup_vs_dense") else ""
        self.progress(f"  {row['model']} {row['context']} x{row['batch']} {row['method']}: "
                      f"tpot {row['tpot_ms']:.2f} ms{floor}{extra}")

    def write_summary(self) -> dict:
        import transformers

        try:
            import triton

            tv = triton.__version__
        except ImportError:
            tv = None
        summary = {
            "config": dataclasses.asdict(self.cfg), "device": _device_name(self.device),
            "versions": {"torch": torch.__version__, "triton": tv, "transformers": transformers.__version__,
                         "cuda": torch.version.cuda},
            "commit": env.get("KVLOCKS_COMMIT"), "backend": self.backend, "cuda_graph": self.use_graph,
            "dense_kernel": DENSE_KERNEL if self.backend == "triton" else DENSE_REFERENCE,
            "dynamo": _dynamo_settings(self.cfg), "launch": _launch_settings(self.device, self.cfg.kernels),
            "copy_gbps": self.copy_gbps, "rows": self.rows, "errors": self.errors,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def run_model(self, name: str) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        mcfg = model_config(name, max_positions=max(1 << 17, *(n + 4096 for n, _ in cfg.cases())),
                            **cfg.model_overrides)
        model = random_model(mcfg, dtype=DTYPES[cfg.dtype], device=self.device, seed=cfg.seed)
        parts = model_parts(model)
        self.prefill_warm = False
        self.progress(f"{name}: built in {time.perf_counter() - t0:.1f} s, "
                      f"{parts.weight_bytes() / 1e9:.1f} GB of weights read per step")
        for n, bsz in cfg.cases():
            self.run_case(parts, name, n, bsz)
        del parts, model
        _free(self.device)

    def run_case(self, parts, name: str, n: int, bsz: int) -> None:
        key = {"model": name, "context": n, "batch": bsz}
        case = None
        try:
            case = _Case(self, parts, name, n, bsz)
            why = case.memory_check()
            if why:
                self.errors.append({**key, "error": why})
                self.progress(f"  {name} {n} x{bsz}: {why}")
                return
            t0 = time.perf_counter()
            shared = case.prepare()
            self.progress(f"  {name} {n} x{bsz}: {shared['fill']} in {time.perf_counter() - t0:.1f} s"
                          + (f" (ttft {shared['ttft_ms']:.0f} ms)" if shared["ttft_ms"] else "")
                          + (f", build {case.build_ms:.0f} ms" if case.build_ms is not None else ""))
            dense_tpot = None
            for method in self.cfg.methods:
                try:
                    row = {**key, **shared, **case.measure(method)}
                except Exception as e:  # one failing method must not sink the case
                    self.errors.append({**key, "method": method, "error": repr(e)[:800]})
                    log.exception("%s %s failed", key, method)
                    self.progress(f"  {name} {n} x{bsz} {method}: ERROR {e!r}"[:300])
                    _free(self.device)
                    continue
                if method == "dense":
                    dense_tpot = row["tpot_ms"]
                row["speedup_vs_dense"] = dense_tpot / row["tpot_ms"] if method != "dense" and dense_tpot else None
                self.emit({k: row.get(k) for k in ROW_KEYS} | {k: v for k, v in row.items() if k not in ROW_KEYS})
        except Exception as e:
            self.errors.append({**key, "error": repr(e)[:800]})
            log.exception("case %s failed", key)
            self.progress(f"  {name} {n} x{bsz}: ERROR {e!r}"[:300])
        finally:
            del case
            _free(self.device)
            self.write_summary()


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def _launch_settings(device: torch.device, kernels: KernelOptions) -> dict:
    """How the step's kernels were launched: programmatic dependent launch (KernelOptions.pdl) for
    kvlocks's kernels where the device supports it, and for the compiled pieces (Inductor's, where
    this torch has it), and the compile mode's batch limit (each row's ``compile_mode`` says which
    mode it ran)."""
    import torch._inductor.config as ic

    from kvlocks import pdl

    return {"pdl": pdl.enabled(device, kernels.pdl),
            "inductor_pdl": kernels.pdl and hasattr(ic.triton, "enable_pdl") and device.type == "cuda",
            "compile_mode": COMPILE_MODE, "compile_mode_max_batch": kernels.compile_mode_max_batch}


def _dynamo_settings(cfg: "E2EBenchConfig") -> dict:
    """Dynamo settings of the benchmark run (those this torch has)."""
    import torch._dynamo.config as dc

    want = {"recompile_limit": cfg.recompile_limit, "fail_on_recompile_limit_hit": True}
    return {k: v for k, v in want.items() if hasattr(dc, k)}


def run_e2e_bench(out_dir, config: E2EBenchConfig | None = None, *, device=None, progress=None) -> dict:
    """Run the benchmark; write ``summary.json`` and ``rows.jsonl`` under ``out_dir``; return the summary."""
    import torch._dynamo.config as dc

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = config or E2EBenchConfig()
    with dc.patch(**_dynamo_settings(cfg)):
        return _run(out_dir, cfg, device, progress)


def _run(out_dir, cfg: E2EBenchConfig, device, progress) -> dict:
    bench = E2EBench(out_dir, cfg, device, progress)
    bench.write_summary()
    for name in cfg.models:
        try:
            bench.run_model(name)
        except Exception as e:
            bench.errors.append({"model": name, "error": repr(e)[:800]})
            log.exception("model %s failed", name)
            bench.progress(f"{name}: ERROR {e!r}"[:300])
            _free(device)
        bench.write_summary()
    return bench.write_summary()
