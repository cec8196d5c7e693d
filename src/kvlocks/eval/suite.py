"""``kvlocks eval``: the task-suite grid, resumable, with a progress bar and result files."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlocks._config_io import ConfigIO
from kvlocks.config import LocksConfig

log = logging.getLogger(__name__)

DEFAULT_TASKS = ("passkey", "niah_single_noise", "niah_single_text", "niah_multikey", "qa_doc", "vt_2hop", "cwe")


@dataclass(frozen=True, kw_only=True)
class EvalConfig(ConfigIO):
    """The grid of one evaluation run (its JSON goes into summary.json)."""

    model: str = "smollm2-135m"
    tasks: tuple[str, ...] = DEFAULT_TASKS
    lengths: tuple[int, ...] = (2048, 4096, 8192)
    budgets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    methods: tuple[str, ...] = ("full", "locks", "oracle", "quest")
    samples: int = 10
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    rank: int = 8
    basis_bits: int = 4
    combine: str = "mean_share"

    def __post_init__(self) -> None:
        from kvlocks.eval.tasks import TASKS
        from kvlocks.integrations.hf import method_names

        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"EvalConfig.tasks: unknown task {t!r}; allowed {sorted(TASKS)}")
        for m in self.methods:
            if m not in method_names():
                raise ValueError(f"EvalConfig.methods: unknown method {m!r}; allowed {method_names()}")
        for n in self.lengths:
            if n < 256:
                raise ValueError(f"EvalConfig.lengths: {n} is too short; lengths must be >= 256 tokens")
        if self.samples < 1:
            raise ValueError(f"EvalConfig.samples={self.samples}: must be >= 1")
        if not self.budgets:
            raise ValueError("EvalConfig.budgets: at least one budget is required")
        for b in self.budgets:  # validated by LocksConfig, which names the rule
            self.locks_config(b)

    def locks_config(self, budget: int) -> LocksConfig:
        return LocksConfig(budget=budget, rank=self.rank, basis_bits=self.basis_bits, combine=self.combine)


def run_eval(cfg: EvalConfig, out: Path, *, model=None, tok=None, progress: bool = True) -> dict:
    """Run (or resume) the grid into ``out/rows.jsonl``; write summary.json, results.md, plots."""
    import torch
    from tqdm import tqdm

    from kvlocks.eval.report import write_report
    from kvlocks.eval.runner import load_done, run_record
    from kvlocks.eval.tasks import generate

    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = load_done(rows_path)
    if model is None:
        from kvlocks.commands._common import DTYPES
        from kvlocks.models import load

        model, tok = load(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    per_record = sum(1 if m == "full" else len(cfg.budgets) for m in cfg.methods)
    jobs = [(t, n) for n in cfg.lengths for t in cfg.tasks]
    bar = tqdm(total=len(jobs) * cfg.samples * per_record, disable=not progress, unit="run", desc="eval")
    bar.update(len(done))
    base = cfg.locks_config(cfg.budgets[0])
    with rows_path.open("a") as fh:
        def write(row):
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            done[(row["task"], row["length"], row["index"], row["method"], row["budget"])] = row
            bar.update(1)

        for task, length in jobs:
            bar.set_postfix_str(f"{task}@{length}")
            for record in generate(task, tok, length, cfg.samples, seed=cfg.seed):
                with torch.inference_mode():
                    run_record(model, tok, record, cfg.methods, cfg.budgets, base, eos, done, write)
    bar.close()
    rows = [r for r in done.values() if r["task"] in cfg.tasks and r["length"] in cfg.lengths]
    return write_report(rows, out, config=asdict(cfg), device=str(model.device))
