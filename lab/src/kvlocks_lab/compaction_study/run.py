"""Run the compaction study over the task records and write its result files.

Files written to ``out``:

* ``heads.jsonl``: one row per (record, ratio, method, layer, KV head) (:mod:`.study_record`);
* ``records.jsonl``: one row per (record, method, ratio), ``full`` included;
* ``solvers.jsonl``: the bias-solver comparison rows (:mod:`.study_solvers`);
* ``qu_samples.npz``: pooled q.u - 1 samples and histograms; ``run.json``: config, wall time;
* ``summary.json``, ``report.md`` and PNG plots (:mod:`.study_summary`, :mod:`.study_report`,
  :mod:`.study_plots`), all made from the files above by :func:`rebuild`.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch

from .config import StudyConfig
from .measure import DELTA_EDGES
from .record import study_record
from .summary import commit, versions

logger = logging.getLogger(__name__)


def far_text_ids(tok, count: int, seed: int) -> list[int]:
    """``count`` tokens of natural prose from a seeded offset (the far continuation)."""
    from kvlocks.corpus import natural_slice, natural_units

    if count == 0:
        return []
    start = random.Random(seed).randrange(len(natural_units()))
    ids: list[int] = []
    units = 64
    while len(ids) < count:
        text = "".join(natural_slice(units, start))
        ids = tok(text, add_special_tokens=False).input_ids
        units *= 2
    return ids[:count]


def run_study(cfg: StudyConfig, out: Path, *, model=None, tok=None, progress: bool = True) -> dict:
    """Run every record of ``cfg`` and write the result files to ``out``; returns the summary."""
    from tqdm import tqdm

    from kvlocks_lab.eval.tasks import generate

    if not isinstance(cfg, StudyConfig):
        raise ValueError(f"cfg must be a StudyConfig, got {type(cfg).__name__}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        from kvlocks.commands.common import DTYPES
        from kvlocks.models import load

        model, tok = load(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    start = time.perf_counter()
    jobs = [(task, length) for length in cfg.lengths for task in cfg.tasks]
    bar = tqdm(total=len(jobs) * cfg.samples, unit="record", desc="compaction-study",
               disable=not progress)
    hist: dict[str, list[int]] = {}
    samples: dict[str, list[torch.Tensor]] = {"near": [], "far": []}
    files = {name: (out / f"{name}.jsonl").open("w") for name in ("heads", "records", "solvers")}
    try:
        for task, length in jobs:
            for record in generate(task, tok, length, cfg.samples, seed=cfg.seed):
                far = far_text_ids(tok, cfg.far_tokens, cfg.seed * 7919 + record.index)

                def note(stage: str, name=f"{task}@{length}#{record.index}") -> None:
                    bar.set_postfix_str(f"{name} {stage}")

                res = study_record(model, tok, record, cfg, far, progress=note)
                for name, rows in (("heads", res.heads), ("records", res.records),
                                   ("solvers", res.solvers)):
                    files[name].writelines(json.dumps(row) + "\n" for row in rows)
                    files[name].flush()
                for where, counts in res.qu_hist.items():
                    hist[where] = [a + b for a, b in zip(hist.get(where, [0] * len(counts)), counts)]
                    samples[where] += res.qu_samples[where]
                bar.update(1)
                logger.info("record %s@%d#%d done", task, length, record.index)
    finally:
        for fh in files.values():
            fh.close()
    bar.close()
    # pooled q.u - 1 samples (<= 256 per record, layer and head) and histograms, for rebuild()
    np.savez_compressed(out / "qu_samples.npz",
                        **{w: torch.cat(s).numpy().astype(np.float16) for w, s in samples.items() if s},
                        **{f"hist_{w}": np.asarray(c, dtype=np.int64) for w, c in hist.items()})
    meta = {"config": cfg.to_json(), "wall_s": time.perf_counter() - start,
            "device": str(model.device), "delta_edges": list(DELTA_EDGES), "commit": commit(),
            "versions": versions()}
    (out / "run.json").write_text(json.dumps(meta, indent=1) + "\n")
    return rebuild(out)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rebuild(out: Path) -> dict:
    """Recompute ``summary.json``, ``report.md`` and the plots from a study directory's files.

    Reads ``run.json`` (config, wall time, device), ``heads.jsonl``, ``records.jsonl``,
    ``solvers.jsonl`` and ``qu_samples.npz``; runs no model. Without q.u samples on disk the
    q.u quantiles of an existing ``summary.json`` are kept. Returns the summary.
    """
    from .plots import plot_all
    from .report import write_report
    from .solvers import summarize_solvers
    from .summary import qu_layers_from_heads, summarize

    out = Path(out)
    for name in ("run.json", "heads.jsonl", "records.jsonl"):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out / name} is missing: not a compaction-study directory "
                                    "(run `kvlocks compaction-study --out DIR` first)")
    meta = json.loads((out / "run.json").read_text())
    cfg = StudyConfig.from_json(meta["config"])
    heads, records = _read_jsonl(out / "heads.jsonl"), _read_jsonl(out / "records.jsonl")
    solvers = _read_jsonl(out / "solvers.jsonl")
    qu, hist = {}, {}
    if (out / "qu_samples.npz").is_file():
        with np.load(out / "qu_samples.npz") as z:
            qu = {w: z[w].astype(np.float64) for w in ("near", "far") if w in z}
            hist = {w: z[f"hist_{w}"].tolist() for w in ("near", "far") if f"hist_{w}" in z}
    extra = {"bias_solvers": {"by_t": summarize_solvers(solvers), "fits": solvers}} if solvers else None
    summary = summarize(cfg, heads, records, qu_layers_from_heads(heads), hist, qu,
                        wall_s=meta["wall_s"], device=meta["device"], extra=extra,
                        delta_edges=tuple(meta.get("delta_edges", DELTA_EDGES)),
                        run_commit=meta.get("commit"), run_versions=meta.get("versions"))
    old = out / "summary.json"
    if not qu and old.is_file():  # no samples on disk: keep the quantiles the run computed
        previous = json.loads(old.read_text())["aggregate"]["qu_minus_1"]
        for where in ("near", "far"):
            summary["aggregate"]["qu_minus_1"][where] = previous.get(where)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_all(summary, heads, out)
    write_report(summary, out)
    return summary
