"""``run_fidelity``: prompts -> captures (safetensors) -> per-layer measurements -> result files.

Output directory:

- ``rows.jsonl``: one JSON row per measurement (:mod:`kvlocks_lab.fidelity.measure`);
- ``summary.json``: config, commit, versions, timings and the aggregates
  (:mod:`kvlocks_lab.fidelity.summary`);
- ``share_scatter.json``: sampled (exact, estimated) page-mass shares for the share figure;
- ``adaptive.json`` / ``adaptive.csv``: the adaptive-precision table, when such variants ran;
- PNG figures (:mod:`kvlocks_lab.fidelity.plots`).

Captures go to ``captures`` (a directory; reused when a file for the same prompt, model and
settings exists) or to a temporary directory removed at the end.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvlocks_lab.fidelity.adaptive import calibration_ranges
from kvlocks_lab.fidelity.capture import capture_prompt, load_capture, save_capture
from kvlocks_lab.fidelity.config import FidelityConfig
from kvlocks_lab.fidelity.exact import LayerData
from kvlocks_lab.fidelity.measure import LayerMeasure
from kvlocks_lab.fidelity.prompts import build_prompts, shared_sentences
from kvlocks_lab.fidelity.scopes import GlobalBases
from kvlocks_lab.fidelity.tails import TailStats
from kvlocks_lab.fidelity.variants import Resources

log = logging.getLogger(__name__)


def _capture_all(model, prompts, config: FidelityConfig, folder: Path, bar) -> dict[str, Path]:
    """Capture every prompt (reusing matching files in ``folder``); returns name -> path."""
    paths = {}
    for p in prompts:
        path = folder / f"{p.name}.safetensors"
        want = {**p.meta(), "model": config.model, "dtype": config.dtype}
        q = 1 if p.kind == "calibration" else config.queries
        reuse = False
        if path.is_file():
            try:
                old = load_capture(path)
                reuse = ({k: old.meta.get(k) for k in want} == want and old.queries.shape[3] == q
                         and old.page_size == config.page_size)
            except ValueError as exc:
                log.warning("recapturing %s: %s", path, exc)
        if not reuse:
            bar.set_postfix_str(f"capture {p.name}")
            c = capture_prompt(model, p, queries=q, page_size=config.page_size)
            c.meta.update(model=config.model, dtype=config.dtype)
            save_capture(path, c)
        paths[p.name] = path
        bar.update(1)
    return paths


def _indices(asked: tuple[int, ...], total: int, what: str) -> list[int]:
    bad = [i for i in asked if i >= total]
    if bad:
        raise ValueError(f"FidelityConfig.{what}={asked}: indices must be < {total}")
    return list(asked) if asked else list(range(total))


def _write_adaptive(out: Path, summary: dict) -> None:
    """``adaptive.json`` and ``adaptive.csv`` (one row per basis precision) when adaptive variants ran."""
    import csv

    from kvlocks_lab.fidelity.summary import adaptive_report

    rows = adaptive_report(summary)
    if not rows:
        return
    (out / "adaptive.json").write_text(json.dumps({"config": summary["config"], "commit": summary["commit"],
                                                   "adaptive": summary["quant_tails"].get("adaptive", {}),
                                                   "rows": rows}, indent=1))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (out / "adaptive.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def run_fidelity(config: FidelityConfig, out: Path, *, model=None, tok=None, captures: Path | None = None,
                 progress: bool = True) -> dict:
    """Run ``config`` and write the result files into ``out``; returns the summary dict."""
    import torch
    from tqdm import tqdm

    from kvlocks_lab.fidelity import plots
    from kvlocks_lab.fidelity.summary import summarize
    from kvlocks_lab.selectors import LokiCalibration

    t0, load0 = time.perf_counter(), os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        from kvlocks.commands.common import DTYPES
        from kvlocks.models import load

        model, tok = load(config.model, dtype=DTYPES[config.dtype], device=config.device)
    text = model.config.get_text_config(decoder=True)
    layers = _indices(config.layers, text.num_hidden_layers, "layers")
    heads = _indices(config.kv_heads, text.num_key_value_heads, "kv_heads")
    prompts, calib = build_prompts(config, tok)
    overlap = shared_sentences(calib, prompts) if calib is not None else 0
    if overlap:
        raise ValueError(f"calibration prose shares {overlap} sentences with the evaluated prompts")
    tmp = None
    if captures is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvlocks-fidelity-")
        captures = Path(tmp.name)
    timings = {}
    try:
        bar = tqdm(total=len(prompts) + 1 + len(prompts) * len(layers), unit="step", desc="fidelity",
                   disable=not progress)
        t1 = time.perf_counter()
        with torch.inference_mode():
            paths = _capture_all(model, [calib, *prompts] if calib is not None else prompts, config, Path(captures),
                                 bar)
        timings["capture_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        res = Resources(page_size=config.page_size, rank=config.rank, seed=config.seed)
        if calib is not None:
            cal = load_capture(paths["calibration"])
            calib_keys = [cal.keys[i][heads] for i in range(cal.num_layers)]
            res = Resources(page_size=config.page_size, rank=config.rank, loki=LokiCalibration.fit(calib_keys),
                            global_bases=GlobalBases.fit(calib_keys, config.page_size), seed=config.seed,
                            calib_norm_ranges=calibration_ranges(calib_keys, config.page_size))
            del cal, calib_keys
        rows, scatter, tails = [], {}, TailStats(config.seed)
        rng = np.random.default_rng(config.seed)
        with (out / "rows.jsonl").open("w") as fh:
            for p in prompts:
                c = load_capture(paths[p.name])
                base = {"prompt": p.name, "task": p.task or p.kind}
                for layer in layers:
                    bar.set_postfix_str(f"{p.name} layer {layer}")
                    k, v, q, scale = c.layer(layer)
                    data = LayerData(keys=k[heads], values=v[heads], queries=q[heads], scale=scale,
                                     page_size=config.page_size, layer=layer, carrier_pages=c.carrier_pages)
                    m = LayerMeasure(data, heads, res, budgets=config.budgets, variants=config.selectors, base=base,
                                     hot_share=config.hot_share, kendall_stride=config.kendall_stride,
                                     scatter_pages=config.scatter_pages, rng=rng)
                    with torch.inference_mode():
                        m.run(tails)
                    for row in m.rows:
                        fh.write(json.dumps(row) + "\n")
                    rows.extend(m.rows)
                    for name, pts in m.scatter.items():
                        scatter.setdefault(name, []).extend(pts)
                    bar.update(1)
                del c
        timings["measure_s"] = time.perf_counter() - t1
        bar.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    (out / "share_scatter.json").write_text(json.dumps(scatter))
    env = {"loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()), "cpus": os.cpu_count(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
           "device": str(model.device)}
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    summary = summarize(rows, config=config, prompts=prompts, calib=calib, calib_overlap=overlap, layers=layers,
                        heads=heads, tails=tails, timings=timings, env=env, res=res, head_dim=head_dim)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _write_adaptive(out, summary)
    plots.plot_all(out)
    timings["total_s"] = time.perf_counter() - t0  # the same dict, now with the plots' time
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
