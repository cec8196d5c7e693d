"""``kvlocks eval --records FILE.jsonl``: every method on your own records (schema: :mod:`.records`).

>>> from kvlocks_lab.eval.records_run import RecordsConfig, run_records
>>> cfg = RecordsConfig(records="mine.jsonl", methods=("full", "locks", "oracle"), budgets=(128, 512))
>>> summary = run_records(cfg, Path("out"), scorers={"yes_no": my_scorer})

Each record is prefilled once (its document, densely); ``full`` and every method x budget decode
the rest from forks of that one prefill, exactly as for the built-in tasks
(:func:`kvlocks_lab.eval.runner.run_record`). Rows are appended to ``OUT/rows.jsonl`` and a run
resumes by skipping rows already there; ``full``'s answer and log-probs are kept in
``OUT/reference/``, so ``full`` is decoded once per record even when methods are added later.
Rows carry the record's ``id``, ``scorer`` and ``record_hash``: resuming into a folder whose rows
came from a different version of a record is an error. ``summary.json``, ``results.md`` and the
plots are those of the built-in tasks, grouped by the records' ``task`` and ``length``; every
task counts towards accuracy (no minimum score of ``full``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlocks_lab.eval.grid import GridSettings
from kvlocks_lab.eval.records import SCORERS, RecordError, check_record, prepare, read_records


@dataclass(frozen=True, kw_only=True)
class RecordsConfig(GridSettings):
    """One run over a records file (its JSON goes into summary.json). Fields as in
    :class:`~kvlocks_lab.eval.grid.GridSettings`; ``records`` is the JSONL file's path."""

    records: str

    def __post_init__(self) -> None:
        self._check_methods()
        object.__setattr__(self, "records", str(self.records))
        self._check_budgets_and_compaction()

    def runs_per_record(self) -> int:
        from kvlocks_lab.eval.methods import parse_methods

        return sum(len(self.budgets) if s.budgeted else 1 for s in parse_methods(self.methods))


def _scorer(scorers: dict):
    """The runner's ``scorer(record, text) -> {"score"}``, checking what a scorer returns."""
    def score(record, text: str) -> dict:
        value = scorers[record.scorer](text, list(record.references))
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
            raise ValueError(f"scorer {record.scorer!r} returned {value!r} for record {record.index + 1}: "
                             "a scorer must return a number in [0, 1] (or a bool)")
        return {"score": float(value)}
    return score


def read(cfg: RecordsConfig, records=None, scorers=None) -> tuple[list[tuple[int, dict]], str]:
    """``(line, record)`` pairs of ``cfg.records`` (or of the dicts ``records``, given from
    Python), checked against the scorer names, and the default task name."""
    names = tuple(scorers or SCORERS)
    if records is None:
        return read_records(Path(cfg.records), names), Path(cfg.records).stem
    if not records:
        raise RecordError("records: the list is empty")
    return [(i + 1, check_record(r, i + 1, i + 1, names)) for i, r in enumerate(records)], "records"


def check_resume(records: list, done: dict) -> None:
    """Rows in ``done`` must come from these records' current contents."""
    hashes = {(r.task, r.length, r.index): r.row_fields["record_hash"] for r in records}
    for row in done.values():
        want = hashes.get((row["task"], row["length"], row["index"]))
        if want is not None and row.get("record_hash") not in (None, want):
            raise RecordError(f"rows.jsonl holds rows of record {row['index'] + 1} made from other contents "
                              f"(record_hash {row['record_hash']}, now {want}); use a new --out folder")


def run_records(cfg: RecordsConfig, out: Path, *, records=None, scorers: dict | None = None, model=None, tok=None,
                progress: bool = True) -> dict:
    """Run (or resume) ``cfg`` into ``out``; returns summary.json's content.

    ``records``: a list of record dicts instead of reading ``cfg.records``; ``scorers``: extra
    ``{name: fn(prediction, answers) -> float in [0, 1]}`` that records may name.
    """
    import gc

    import torch
    from tqdm import tqdm

    from kvlocks_lab.eval.report import git_commit, write_report
    from kvlocks_lab.eval.runner import load_done, row_key, run_record

    scorers = {**SCORERS, **(scorers or {})}
    for name, fn in scorers.items():
        if not callable(fn):
            raise ValueError(f"scorers[{name!r}] = {fn!r}: must be a callable fn(prediction, answers) -> float")
    pairs, task = read(cfg, records, scorers)  # checked before the model loads
    if model is None:
        from kvlocks.commands.common import DTYPES
        from kvlocks.models import load

        model, tok = load(cfg.model, dtype=DTYPES[cfg.dtype], device=cfg.device)
    prepared = [prepare(tok, rec, i, line, task) for i, (line, rec) in enumerate(pairs)]
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = load_done(rows_path)
    check_resume(prepared, done)
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    keys = {(r.task, r.length, r.index) for r in prepared}
    in_run = lambda r: (r["task"], r["length"], r["index"]) in keys and r["method"] in cfg.methods \
        and (r["budget"] is None or r["budget"] in cfg.budgets)
    bar = tqdm(total=len(prepared) * cfg.runs_per_record(), disable=not progress, unit="run", desc="eval")
    bar.update(sum(1 for r in done.values() if in_run(r)))
    base = cfg.locks_config(cfg.budgets[0])
    from kvlocks_lab.eval.compacted import CompactionSettings

    kw = {"compaction": CompactionSettings(max_queries=cfg.compaction_max_queries,
                                           self_study_tokens=cfg.compaction_self_study_tokens),
          "cache_dir": out / "compacted", "reference_dir": out / "reference", "scorer": _scorer(scorers),
          "question": cfg.question}
    commit = git_commit()
    with rows_path.open("a") as fh:
        def write(row):
            row.setdefault("commit", commit)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            done[row_key(row)] = row
            bar.update(1)

        for record in prepared:
            bar.set_postfix_str(f"record {record.index + 1}/{len(prepared)}, {record.length} tokens")
            kw["progress"] = lambda msg, _i=record.index: bar.set_postfix_str(f"record {_i + 1}: {msg}")
            with torch.inference_mode():
                run_record(model, tok, record, cfg.methods, cfg.budgets, base, eos, done, write, **kw)
            gc.collect()
    bar.close()
    rows = [r for r in done.values() if in_run(r)]
    return write_report(rows, out, config=asdict(cfg), device=str(model.device), min_full_score=0.0)
