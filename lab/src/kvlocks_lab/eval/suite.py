"""``kvlocks eval``: the task-suite grid, resumable, with a progress bar and result files."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlocks.config_io import check_int
from kvlocks_lab.eval.grid import GridSettings

log = logging.getLogger(__name__)

DEFAULT_TASKS = ("passkey", "niah_single_noise", "niah_single_text", "niah_multikey", "qa_doc", "vt_2hop", "cwe",
                 "ppl_continuation")


def task_names() -> tuple[str, ...]:
    """Every task ``--tasks`` accepts: the RULER-style tasks and ``ppl_continuation``."""
    from kvlocks_lab.eval.continuation import PPL_TASK
    from kvlocks_lab.eval.tasks import TASKS

    return (*TASKS, PPL_TASK)


@dataclass(frozen=True, kw_only=True)
class EvalConfig(GridSettings):
    """The grid of one evaluation run (its JSON goes into summary.json); shared fields in
    :class:`~kvlocks_lab.eval.grid.GridSettings`. ``ppl_tokens``: continuation tokens N scored per
    ``ppl_continuation`` record (context P = length - N); at most half the shortest length.
    ``first_sample``: records with a lower index are skipped (the records keep their indexes, so
    processes given ``[0, a)``, ``[a, b)``, ... of one cell write rows that merge into one run).
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (2048, 4096, 8192)
    samples: int = 10
    first_sample: int = 0
    seed: int = 0
    ppl_tokens: int = 128

    def __post_init__(self) -> None:
        allowed = task_names()
        for t in self.tasks:
            if t not in allowed:
                raise ValueError(f"EvalConfig.tasks: unknown task {t!r}; allowed {list(allowed)}")
        self._check_methods()
        if not self.lengths:
            raise ValueError("EvalConfig.lengths: at least one length is required")
        for n in self.lengths:
            if n < 256:
                raise ValueError(f"EvalConfig.lengths: {n} is too short; lengths must be >= 256 tokens")
        if self.samples < 1:
            raise ValueError(f"EvalConfig.samples={self.samples}: must be >= 1")
        check_int("EvalConfig", "first_sample", self.first_sample, 0, self.samples - 1)
        self._check_budgets_and_compaction()
        check_int("EvalConfig", "seed", self.seed, 0)
        check_int("EvalConfig", "ppl_tokens", self.ppl_tokens, 1, min(self.lengths) // 2)

    def compaction_settings(self):
        from kvlocks_lab.eval.compacted import CompactionSettings

        return CompactionSettings(max_queries=self.compaction_max_queries,
                                  self_study_tokens=self.compaction_self_study_tokens, seed=self.seed)

    def runs_per_record(self) -> int:
        """Rows one record produces: one per budget for selectors, one for full and compactions."""
        from kvlocks_lab.eval.methods import parse_methods

        return sum(len(self.budgets) if s.budgeted else 1 for s in parse_methods(self.methods))


def _records(cfg: EvalConfig, tok, task: str, length: int):
    from kvlocks_lab.eval.continuation import PPL_TASK, generate_continuations
    from kvlocks_lab.eval.tasks import generate

    if task == PPL_TASK:
        return generate_continuations(tok, length, cfg.samples, cfg.ppl_tokens, seed=cfg.seed)
    return generate(task, tok, length, cfg.samples, seed=cfg.seed)


def run_eval(cfg: EvalConfig, out: Path, *, model=None, tok=None, progress: bool = True) -> dict:
    """Run (or resume) the grid into ``out/rows.jsonl``; write summary.json, results.md, plots.

    Compaction fits in progress are kept in ``out/compacted/`` until their record is done;
    ``full``'s answers and log-probs in ``out/reference/`` (so a resumed or extended run does
    not decode ``full`` again).
    """
    import torch
    from tqdm import tqdm

    import gc
    from kvlocks_lab.eval.continuation import PPL_TASK
    from kvlocks_lab.eval.ppl import run_continuation
    from kvlocks_lab.eval.report import git_commit, write_report
    from kvlocks_lab.eval.runner import load_done, row_key, run_record

    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = load_done(rows_path)
    if model is None:
        from kvlocks.commands.common import DTYPES
        from kvlocks.models import load

        model, tok = load(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    jobs = [(t, n) for n in cfg.lengths for t in cfg.tasks]
    in_grid = lambda r: r["task"] in cfg.tasks and r["length"] in cfg.lengths and r["method"] in cfg.methods \
        and (r["budget"] is None or r["budget"] in cfg.budgets) and cfg.first_sample <= r["index"] < cfg.samples
    bar = tqdm(total=len(jobs) * (cfg.samples - cfg.first_sample) * cfg.runs_per_record(), disable=not progress, unit="run", desc="eval")
    bar.update(sum(1 for r in done.values() if in_grid(r)))
    base = cfg.locks_config(cfg.budgets[0])
    kw = {"compaction": cfg.compaction_settings(), "cache_dir": out / "compacted"}
    commit = git_commit()  # the code that produces this run's rows (a resumed run may mix commits)
    with rows_path.open("a") as fh:
        def write(row):
            row.setdefault("commit", commit)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            done[row_key(row)] = row
            bar.update(1)

        for task, length in jobs:
            bar.set_postfix_str(f"{task}@{length}")
            kw["progress"] = lambda msg, _tl=f"{task}@{length}": bar.set_postfix_str(f"{_tl}: {msg}")
            for record in _records(cfg, tok, task, length)[cfg.first_sample:]:
                with torch.inference_mode():
                    if task == PPL_TASK:
                        run_continuation(model, tok, record, cfg.methods, cfg.budgets, base, done, write, **kw)
                    else:
                        run_record(model, tok, record, cfg.methods, cfg.budgets, base, eos, done, write,
                                   reference_dir=out / "reference", question=cfg.question, **kw)
                gc.collect()  # frees the record's caches before the next one
    bar.close()
    rows = [r for r in done.values() if in_grid(r)]
    return write_report(rows, out, config=asdict(cfg), device=str(model.device))
