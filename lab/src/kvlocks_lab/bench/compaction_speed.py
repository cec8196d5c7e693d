"""Compaction speed and error: the pipeline at another commit against this tree's, side by side.

``python -m kvlocks_lab.bench.compaction_speed --out DIR [--before-rev REV] [--tokens 4096]
[--device cuda --dtype bfloat16]``

``--before-rev`` names a commit whose ``src/kvlocks/compaction`` is the "before" library; it is
read with ``git show`` into a temporary package, so both libraries run in one process on the
same prefix (without it, this tree alone: a machine with no git history, such as the GPU
machine) (``--tokens`` tokens of stdlib prose, the bundled model). Two or three runs of what
``kvlocks compact`` does (capture with the default reference passes, then the fit of every layer
as it runs them, several layers' heads in one batched fit on a GPU; method ``--method`` at
``--ratio``):

* ``before``: the before library;
* ``after_whole`` (with ``--whole``): this tree, the repeat pass over the whole prefix
  (``repeat_tokens = T``): what the capture's other changes alone gain. It reaches position
  2T + 12, so T = 4,096 is refused on the bundled model's 8,192 positions;
* ``after_sequential`` (with ``--sequential``): this tree with the generating passes (self-study,
  questions) run one after another instead of as one batch (:mod:`kvlocks.integrations.hf.compaction.capture_batch`);
* ``after``: this tree's defaults (the repeat pass in spans, :mod:`kvlocks.integrations.hf.compaction.passes`).

The model runs on ``--device`` in ``--dtype``; the captured keys, values and queries are float32
and every layer's fit runs on the same device (as ``kvlocks compact --device`` does), timed
after a device synchronisation. Each run records seconds per capture pass and per layer (``after`` runs also per stage, from
``compact_layer``'s ``timings``) and the compacted prefix's output error on held-out queries:
the queries of the ``--heldout-tokens`` tokens of prose that follow the prefix, fed on the full
prefix cache in the ``after`` capture and kept out of every fit. Per (layer, KV head)
``err = mean_j ||o_c(q_j) - o_full(q_j)|| / mean_j ||o_full(q_j)||`` over the prefix entries
(t compacted against T), as served (``am`` with its bias). Kept positions are compared with
``before``.

``--profile`` adds ``DIR/profile_capture.txt``: one more capture under ``torch.profiler``.

Writes ``DIR/layers.jsonl`` (one row per run, layer and KV head) and ``DIR/summary.json``
(date, commit, tree state, machine and load, threads, versions, per-pass and per-stage totals,
median errors).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_REPO = Path(__file__).resolve().parents[4]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=True,
                          timeout=30).stdout


def library_at(rev: str):
    """``kvlocks.compaction`` as of commit ``rev``, imported as ``kvlocks_before.compaction``."""
    root = Path(tempfile.mkdtemp(prefix="kvlocks_before_"))
    pkg = root / "kvlocks_before" / "compaction"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    for folder in ("src/kvlocks/compaction/", "src/kvlocks/integrations/hf/compaction/"):  # capture, passes, model
        for path in _git("ls-tree", "--name-only", rev, folder).split():
            if Path(path).name != "__init__.py" or folder.endswith("/kvlocks/compaction/"):
                (pkg / Path(path).name).write_text(_git("show", f"{rev}:{path}"))
    sys.path.insert(0, str(root))
    return importlib.import_module("kvlocks_before.compaction")


def _dirty() -> bool | None:
    """Whether the source tree has uncommitted changes (None: not a git checkout)."""
    try:
        return bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src").strip())
    except (OSError, subprocess.SubprocessError):
        return None


def prose_ids(tok, tokens: int, skip: int = 0) -> torch.Tensor:
    """Tokens ``skip .. skip + tokens`` of the stdlib prose corpus, [1, tokens] int64."""
    from kvlocks.corpus import natural_units

    text, need = "", skip + tokens
    for unit in natural_units() * 8:
        text += unit
        if len(text) > 6 * need:
            break
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, skip:need]
    if ids.shape[1] < tokens:
        raise ValueError(f"--tokens={tokens}: the corpus gives only {ids.shape[1]} tokens after {skip}")
    return ids


def _part(lib, name: str):
    """``lib``'s module ``name``; this tree keeps capture, passes and model in :mod:`kvlocks.integrations.hf.compaction`."""
    import kvlocks.compaction

    return importlib.import_module(f"{'kvlocks.integrations.hf.compaction' if lib is kvlocks.compaction else lib.__name__}.{name}")


def capture(lib, model, tok, ids, cfg, reference, extra=(), **kw):
    """``lib``'s capture of ``ids`` with ``reference``'s passes (plus ``extra``), seconds per pass;
    ``kw`` goes to its ``capture_queries``."""
    cap_mod, pass_mod = _part(lib, "capture"), _part(lib, "passes")
    marks: list[tuple[str, float]] = []
    cap = cap_mod.capture_queries(model, ids, pass_mod.reference_passes(tok, ids, reference) + list(extra),
                                  max_queries=cfg.max_queries, seed=cfg.seed,
                                  progress=lambda name: marks.append((name, time.perf_counter())), **kw)
    ends = [m[1] for m in marks[1:]] + [marks[0][1] + cap.seconds]
    return cap, {name: round(end - at, 3) for (name, at), end in zip(marks, ends)}


def _serving(layer, d: int):
    """Keys [H, t, D], values, bias [H, t] or None of a CompactedLayer, as served."""
    if layer.method == "rank1":
        return layer.keys[..., :d], layer.values, layer.keys[..., d]
    return layer.keys, layer.values, layer.beta


def head_errors(layer, k_full, v_full, q_eval, scale) -> list[float]:
    """err per KV head of one compacted layer on queries ``q_eval`` [H, m, D] (module docstring)."""
    from kvlocks.compaction import exact_attention

    keys, vals, bias = _serving(layer, k_full.shape[-1])
    out = []
    for h in range(k_full.shape[0]):
        full, _ = exact_attention(q_eval[h], k_full[h].float(), v_full[h].float(), scale=scale)
        got, _ = exact_attention(q_eval[h], keys[h], vals[h], scale=scale,
                                 bias=None if bias is None else bias[h])
        out.append(float((got - full).norm(dim=-1).mean() / full.norm(dim=-1).mean()))
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _on_cpu(layer):
    """A fitted layer's tensors on the CPU (the error is measured there, in float32)."""
    return SimpleNamespace(**{name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in vars(layer).items()})


def _chunks(lib, cap, cfg, t: int, dev: torch.device) -> list[list[int]]:
    """The layers ``lib`` fits together on ``dev`` (``kvlocks compact``'s chunks; one layer at a time
    for a library without them)."""
    model_mod = _part(lib, "model")
    if hasattr(model_mod, "layer_chunks") and hasattr(model_mod, "fit_chunk"):
        return model_mod.layer_chunks(cap, t, cfg, dev)
    return [[i] for i in range(len(cap.keys))]


def _fit(lib, cap, chunk: list[int], cfg, t: int, dev: torch.device, timings: dict | None) -> list:
    """Per layer of ``chunk``: ``lib``'s CompactedLayer (or a stand-in with its serving fields)."""
    model_mod = _part(lib, "model")
    if not hasattr(model_mod, "fit_chunk"):
        (i,) = chunk
        k, v, q = cap.keys[i].to(dev, torch.float32), cap.values[i].to(dev, torch.float32), cap.queries[i].to(dev)
        kw = {"timings": timings} if timings is not None else {}
        return [lib.compact_layer(k, v, q, t, cfg, scale=cap.scales[i], **kw)]
    fitted = model_mod.fit_chunk(cap, chunk, t, cfg, dev, timings)
    return [SimpleNamespace(method=cfg.method, keys=k, values=v, beta=b, indices=idx) for k, v, b, idx in fitted]


def compact_run(lib, cap, cfg, t: int, q_eval, stages: bool,
                dev: torch.device = torch.device("cpu")) -> tuple[list[dict], dict]:
    """``lib``'s fit of every layer on ``dev``, the layers chunked as ``kvlocks compact`` chunks them
    (on a GPU, several layers' heads in one batched fit): rows per (layer, head) and stage seconds.
    A chunk's seconds are shared equally by its layers (``layer_s``; ``chunk_s`` the whole)."""
    rows, timings = [], {}
    for chunk in _chunks(lib, cap, cfg, t, dev):
        _sync(dev)
        start = time.perf_counter()
        layers = _fit(lib, cap, chunk, cfg, t, dev, timings if stages else None)
        _sync(dev)
        seconds = time.perf_counter() - start
        for i, layer in zip(chunk, layers):
            layer = _on_cpu(layer)
            errs = head_errors(layer, cap.keys[i].cpu(), cap.values[i].cpu(), q_eval[i], cap.scales[i])
            for h, err in enumerate(errs):
                rows.append({"layer": i, "head": h, "layer_s": round(seconds / len(chunk), 4),
                             "chunk_s": round(seconds, 4), "chunk": [chunk[0], chunk[-1]],
                             "err": float(f"{err:.5g}"), "indices": layer.indices[h].tolist()})
    return rows, {n: round(x, 3) for n, x in timings.items()}


def _comparison(runs, indices, summary_runs, compared) -> dict:
    """Speed-ups over ``before`` and how many kept positions are the same."""
    same = {name: sum(a == b for a, b in zip(indices[name], indices["before"])) / len(indices["before"])
            for name in compared}
    overlap = {name: statistics.fmean(len(set(a) & set(b)) / len(b)
                                      for a, b in zip(indices[name], indices["before"]))
               for name in compared}
    same_kv = all(torch.equal(a, b) for a, b in zip(runs["after"][0].keys, runs["before"][0].keys))
    return {"same_prefix_kv": same_kv,
            "speedup_total": {n: round(summary_runs["before"]["total_s"] / summary_runs[n]["total_s"], 2)
                              for n in compared},
            "kept_same_as_before": {"heads_identical": same, "mean_overlap": overlap}}


def run(args) -> dict:
    import kvlocks.compaction as after_lib
    from kvlocks.integrations.hf.compaction.passes import QueryPass, ReferenceConfig
    from kvlocks.models import load
    from kvlocks_lab.compaction_study.summary import commit, versions

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before_lib = library_at(args.before_rev) if args.before_rev else None
    load_start = os.getloadavg()
    dev = torch.device(args.device)
    model, tok = load(args.model, dtype=getattr(torch, args.dtype), device=dev)
    ids = prose_ids(tok, args.tokens)
    heldout = QueryPass("heldout", prose_ids(tok, args.heldout_tokens, skip=args.tokens))
    cfg = after_lib.CompactionConfig(method=args.method, ratio=args.ratio)
    before_cfg = before_lib.CompactionConfig(method=args.method, ratio=args.ratio) if before_lib else None
    if dev.type == "cuda":  # kernels loaded and the allocator warm before anything is timed
        warm, _ = capture(after_lib, model, tok, ids[:, :256], cfg, ReferenceConfig(self_study_tokens=2))
        compact_run(after_lib, warm.only(list(warm.by_pass)), cfg, cfg.budget(256), warm.queries, stages=False,
                    dev=dev)
    t = cfg.budget(ids.shape[1])
    runs = {}
    cap, passes = capture(after_lib, model, tok, ids, cfg, ReferenceConfig(), extra=[heldout])
    q_eval = cap.by_pass["heldout"]  # [H, m, D] per layer, never fitted
    held_s = passes.pop("heldout")
    runs["after"] = (cap.only([n for n in cap.by_pass if n != "heldout"]), passes, held_s)
    if args.whole:  # the repeat over the whole prefix reaches position 2T + L: past 8,192 at T = 4,096
        whole = ReferenceConfig(repeat_tokens=ids.shape[1])
        cap_w, passes_w = capture(after_lib, model, tok, ids, cfg, whole)
        runs["after_whole"] = (cap_w, passes_w, 0.0)
    if args.sequential:  # the generating passes one after another instead of as one batch
        cap_s, passes_s = capture(after_lib, model, tok, ids, cfg, ReferenceConfig(), batch=False)
        runs["after_sequential"] = (cap_s, passes_s, 0.0)
    compared = [n for n in ("after_whole", "after_sequential", "after") if n in runs]
    if before_lib is not None:
        before_ref = importlib.import_module(before_lib.__name__ + ".passes").ReferenceConfig()
        cap_b, passes_b = capture(before_lib, model, tok, ids, before_cfg, before_ref)
        runs["before"] = (cap_b, passes_b, 0.0)
    summary_runs, indices = {}, {}
    with open(out / "layers.jsonl", "w") as fh:
        for name in [n for n in ("before", *compared) if n in runs]:
            c, passes_s, extra_s = runs[name]
            lib, ccfg = (before_lib, before_cfg) if name == "before" else (after_lib, cfg)
            rows, stages = compact_run(lib, c, ccfg, t, q_eval, stages=name != "before", dev=dev)
            capture_s = round(c.seconds - extra_s, 3)
            layers_s = round(sum(r["chunk_s"] for r in rows if r["head"] == 0 and r["layer"] == r["chunk"][0]), 3)
            errs = [r["err"] for r in rows]
            indices[name] = [r.pop("indices") for r in rows]
            for r in rows:
                fh.write(json.dumps({"run": name, **r}) + "\n")
            summary_runs[name] = {
                "capture_s": capture_s, "capture_passes_s": passes_s, "layers_s": layers_s,
                "total_s": round(capture_s + layers_s, 3), "stages_s": stages,
                "err_median": float(f"{statistics.median(errs):.5g}"),
                "err_mean": float(f"{statistics.fmean(errs):.5g}")}
    summary = _comparison(runs, indices, summary_runs, compared) if "before" in runs else {}
    summary = {
        "date": datetime.date.today().isoformat(), "commit": commit(), "src_dirty": _dirty(),
        "before_rev": args.before_rev,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "thread_env": {k: os.environ.get(k) for k in _THREAD_ENV}},
        "versions": versions(), "args": vars(args), "config": json.loads(cfg.to_json()),
        "reference": json.loads(ReferenceConfig().to_json()),
        "T": ids.shape[1], "t": t, "n": int(cap.queries[0].shape[1]),
        "heldout_queries_per_head": int(q_eval[0].shape[1]), "heldout_pass_s": held_s,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": args.dtype,
        "runs": summary_runs, **summary,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.profile:
        profile_capture(after_lib, model, tok, ids, cfg, ReferenceConfig(), out / "profile_capture.txt")
    return summary


def profile_capture(lib, model, tok, ids, cfg, reference, path: Path, rows: int = 40) -> None:
    """One more capture under ``torch.profiler``: operators by self CPU time and by device time,
    each pass's seconds and the process's CPU time against wall time (a capture bound by the
    host shows CPU time near wall time and device time well below it)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with profile(activities=acts) as prof:
        _, passes = capture(lib, model, tok, ids, cfg, reference)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    table = prof.key_averages()
    text = [f"capture under the profiler: wall {wall_s:.2f} s, process CPU {cpu_s:.2f} s; passes (s): {passes}", "",
            table.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if len(acts) > 1:
        text += ["", table.table(sort_by="self_device_time_total", row_limit=rows)]
    path.write_text("\n".join(text))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--before-rev",
                   help="git commit whose src/kvlocks/compaction is the before library (default: none, "
                        "this tree alone)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the model's and the fit's device")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's dtype")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=4096, help="prefix length T")
    p.add_argument("--heldout-tokens", type=int, default=512,
                   help="prose tokens after the prefix whose queries measure the error")
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--method", default="fold")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--sequential", action="store_true",
                   help="also time this tree with the generating passes run one after another (not batched)")
    p.add_argument("--whole", action="store_true",
                   help="also time a repeat pass over the whole prefix (needs 2T + 12 <= the model's positions)")
    p.add_argument("--profile", action="store_true",
                   help="also write profile_capture.txt: one more capture under torch.profiler")
    args = p.parse_args(argv)
    s = run(args)
    print(json.dumps({k: s[k] for k in ("T", "t", "n", "runs", "speedup_total", "kept_same_as_before") if k in s},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
