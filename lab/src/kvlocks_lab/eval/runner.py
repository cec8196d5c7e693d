"""The task-suite runner: one dense prefill per record, every method x budget decoded from a fork.

For each record the context is prefilled once with full attention (LOCKS summaries built at the
end of the prefill). ``full`` then decodes the suffix (question, assistant header, answer prefix)
token by token and generates the reference answer; every other method x budget decodes from a
fork of the same prefilled cache, so selection acts on the question too. Next-token KL and top-1
agreement are teacher-forced on full's answer: while a method's greedy tokens equal full's, its
own path *is* the teacher-forced path; at the first divergence the cache is forked once and the
fork follows full's tokens.

Compaction methods (``fold@0.1``, ...) decode the same suffix over the record's compacted context
(:mod:`kvlocks_lab.eval.shared_prefill`, :mod:`kvlocks_lab.eval.compacted`): once per record, not per budget.

Results are one JSONL row per record x method x budget; a run resumes by skipping rows whose key
is already in the file.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.eval.compacted import CompactionSettings, RecordCompactions
from kvlocks.integrations.hf.decode import step
from kvlocks_lab.eval.methods import parse_method, parse_methods
from kvlocks_lab.eval.metrics import exact_agreement, kl_divergence, prefix_agreement, top1_agreement
from kvlocks_lab.eval.shared_prefill import SharedPrefill, fork_cache
from kvlocks_lab.eval.tasks import TaskRecord, score


def row_key(row: dict) -> tuple:
    return (row["task"], row["length"], row["index"], row["method"], row["budget"])


def load_done(path: Path) -> dict[tuple, dict]:
    """Rows already written (a truncated last line from an interrupted run is ignored)."""
    done: dict[tuple, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[row_key(row)] = row
    return done


def _answer(model, cache, logits, max_new: int, eos: set[int], ref_tokens: list[int] | None = None):
    """Greedy answer from ``logits`` (the prediction after the suffix).

    Returns ``(tokens, logps)``: the greedy tokens, and next-token log-probs ``[V]`` per position
    along full's answer ``ref_tokens`` (teacher-forced), or along the greedy path without one.
    The only host synchronisation per step is reading the greedy token (for EOS).
    """
    tokens: list[int] = []
    logps: list[torch.Tensor] = []
    tf_cache, tf_start = None, 0
    n_ref = 0 if ref_tokens is None else len(ref_tokens)
    for i in range(max_new):
        lp = torch.log_softmax(logits.float(), dim=-1)
        nxt = int(torch.argmax(lp))
        if ref_tokens is None or (tf_cache is None and i < n_ref):
            logps.append(lp)  # still on full's path: the greedy path is the teacher-forced one
            if ref_tokens is not None and nxt != ref_tokens[i]:
                tf_cache, tf_start = fork_cache(cache), i  # diverged: a fork follows full's tokens
        tokens.append(nxt)
        if nxt in eos or i == max_new - 1:  # no step for a token nothing will read
            break
        logits = step(model, cache, nxt)
    if tf_cache is not None:
        for j in range(tf_start, n_ref - 1):
            logps.append(torch.log_softmax(step(model, tf_cache, ref_tokens[j]).float(), dim=-1))
    return tokens, logps


@contextlib.contextmanager
def read_densely(cache, on: bool):
    """While open, a selector's cache reads every page (its selector set aside), when ``on``."""
    selector = getattr(cache, "selector", None)
    if not on or selector is None:
        yield
        return
    cache.selector = None
    try:
        yield
    finally:
        cache.selector = selector


def todo_of(record, methods, budgets, done: dict) -> list:
    """``(MethodSpec, budget)`` pairs of ``record`` not yet in ``done``, ``full`` first."""
    specs = parse_methods(methods)
    pairs = [(s, None) for s in specs if s.kind == "full"]
    pairs += [(s, None) for s in specs if s.kind == "compaction" and not s.budgeted]
    pairs += [(s, b) for s in specs if s.budgeted for b in budgets]
    return [(s, b) for s, b in pairs if (record.task, record.length, record.index, s.name, b) not in done]


def make_compactions(model, tok, record, prefix_ids, todo, compaction, cache_dir, progress):
    """The record's :class:`RecordCompactions` when a compaction method is still to run, else None."""
    if not any(s.kind == "compaction" for s, _ in todo):
        return None
    tag = f"{record.task}-{record.length}-s{record.seed}-i{record.index}"
    return RecordCompactions(model, tok, prefix_ids, compaction or CompactionSettings(),
                             cache_dir=cache_dir, tag=tag, progress=progress)


def reference_tag(record) -> str:
    """File name stem of a record's saved ``full`` reference (unique per record of a run)."""
    tag = getattr(record, "tag", None)
    return tag or f"{record.task}-{record.length}-s{record.seed}-i{record.index}"


def full_reference(model, shared, decode, record, eos: set[int], reference_dir: Path | None):
    """``full``'s greedy answer for ``record``: ``{"tokens", "logp" [n, V] or None, "seconds", "stats"}``.

    Read from ``reference_dir`` when an earlier run saved it (``full`` is then not decoded
    again), else decoded on a fork of the shared prefill and saved there (float32 log-probs:
    4 * V bytes per answer token, 0.2 MB at a 49K vocabulary).
    """
    path = None if reference_dir is None else reference_dir / f"{reference_tag(record)}.pt"
    if path is not None and path.exists():
        return torch.load(path, weights_only=True)
    t1 = time.perf_counter()
    full = shared.open(parse_method("full"), None)
    tokens, logps = _answer(model, full.cache, decode(full), record.max_new_tokens, eos)
    ref = {"tokens": tokens, "logp": torch.stack(logps) if logps else None,
           "seconds": time.perf_counter() - t1, "stats": full.stats()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(ref, tmp)
        tmp.replace(path)  # a run stopped while saving leaves no half-written reference
    return ref


def run_record(model, tok, record: TaskRecord, methods, budgets, base: LocksConfig, eos: set[int],
               done: dict, write, *, compaction: CompactionSettings | None = None,
               cache_dir: Path | None = None, progress=None, scorer=None,
               reference_dir: Path | None = None, question: str = "method") -> None:
    """Decode one record with every method x budget not yet in ``done``; ``write(row)`` each.

    ``methods`` are ``--methods`` spellings (:mod:`kvlocks_lab.eval.methods`); ``compaction`` and
    ``cache_dir`` configure compaction methods; ``progress(str)`` is told about slow stages.
    ``scorer(record, text) -> dict`` gives the score fields (default: the task's
    :func:`~kvlocks_lab.eval.tasks.score`); ``reference_dir`` keeps ``full``'s answer and
    log-probs (:func:`full_reference`), so ``full`` is decoded once per record across runs.
    ``question="dense"`` reads the question with full attention on every method's cache
    (:func:`read_densely`; :class:`~kvlocks_lab.eval.grid.GridSettings`).
    """
    todo = todo_of(record, methods, budgets, done)
    if not todo:
        return
    scorer = scorer or score
    compactions = make_compactions(model, tok, record, record.context_ids, todo, compaction, cache_dir, progress)
    shared = SharedPrefill(model, record.context_ids, base, budgets, compactions=compactions)
    suffix = record.suffix_ids

    def decode(opened):
        logits = shared.logits
        with opened.context(), read_densely(opened.cache, question == "dense"):
            for t in suffix:
                logits = step(model, opened.cache, t)
        return logits

    ref = full_reference(model, shared, decode, record, eos, reference_dir)
    ref_tokens, ref_logp = ref["tokens"], ref["logp"]
    for spec, budget in todo:
        if spec.kind == "full":
            tokens, kl, top1, seconds, stats, fields = ref_tokens, 0.0, 1.0, ref["seconds"], ref["stats"], {}
        else:
            opened = shared.open(spec, budget)  # compactions: fitted here, timed in compact_s
            t1 = time.perf_counter()
            logits = decode(opened)
            with opened.context():
                tokens, logps = _answer(model, opened.cache, logits, record.max_new_tokens, eos, ref_tokens)
            n = min(len(logps), ref_logp.shape[0])
            lp = torch.stack(logps[:n])
            kl = float(kl_divergence(ref_logp[:n], lp).mean())
            top1 = float(top1_agreement(ref_logp[:n], lp).float().mean())
            seconds, stats, fields = time.perf_counter() - t1, opened.stats(), opened.fields
        text = tok.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
        row = {
            "task": record.task, "length": record.length, "index": record.index, "seed": record.seed,
            "depth": record.depth, "method": spec.name, "budget": budget,
            "prompt_tokens": len(record.context_ids) + len(record.suffix_ids), "question": question,
            **getattr(record, "row_fields", {}),
            **scorer(record, text), "prediction": text, "references": record.references,
            "exact_agree": exact_agreement(ref_tokens, tokens), "agree16": prefix_agreement(ref_tokens, tokens, 16),
            "kl": kl, "top1": top1, "tokens": tokens, "seconds": seconds,
            "prefill_s": shared.prefill_s, **fields, **{f"stats_{k}": v for k, v in stats.items()},
        }
        write(row)
    if compactions is not None:
        compactions.cleanup()
