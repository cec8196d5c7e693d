"""Perplexity of natural-text continuations with each method active (``ppl_continuation``).

Per record (:mod:`kvlocks_lab.eval.continuation`): the first P - 1 context tokens are prefilled
once, densely; every method x budget then feeds the last context token and the continuation,
one decode step per token, teacher-forced on the true text, and scores the N continuation
tokens. Rows carry the per-record mean negative log-likelihood ``nll`` (nats per token),
``ppl = exp(nll)``, and, against ``full`` at the same positions, the mean next-token
KL(full || method) and top-1 agreement. The loop never synchronises with the device: targets
live on the device and the per-token values are read back once per method.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from kvlocks.config import LocksConfig
from kvlocks_lab.eval.compacted import CompactionSettings
from kvlocks_lab.eval.continuation import ContinuationRecord
from kvlocks.integrations.hf.decode import step
from kvlocks_lab.eval.methods import parse_method
from kvlocks_lab.eval.metrics import kl_divergence
from kvlocks_lab.eval.runner import make_compactions, todo_of
from kvlocks_lab.eval.shared_prefill import Opened, SharedPrefill


def teacher_forced_logprobs(model, opened: Opened, feed_ids: list[int]) -> torch.Tensor:
    """Log-probs ``[N, V]`` float32: row i is the next-token distribution after ``feed_ids[i]``,
    each from a decode step on the method's cache (none comes from the dense prefill)."""
    rows = []
    with opened.context():
        for t in feed_ids:
            rows.append(torch.log_softmax(step(model, opened.cache, t), dim=-1))
    return torch.stack(rows)  # [N, V]


def continuation_metrics(logp: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None) -> dict:
    """Per-record NLL, perplexity, and KL / top-1 against ``ref`` (full's log-probs ``[N, V]``)."""
    tok_lp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    out = {"nll": -tok_lp.mean(), "kl": None, "top1": None}
    if ref is not None:
        out["kl"] = kl_divergence(ref, logp).mean()
        out["top1"] = (ref.argmax(-1) == logp.argmax(-1)).float().mean()
    vals = {k: (None if v is None else float(v)) for k, v in out.items()}  # the one read-back
    vals["ppl"] = math.exp(vals["nll"]) if vals["nll"] < 700 else math.inf  # exp overflows past ~709
    return vals


def run_continuation(model, tok, record: ContinuationRecord, methods, budgets, base: LocksConfig,
                     done: dict, write, *, compaction: CompactionSettings | None = None,
                     cache_dir: Path | None = None, progress=None) -> None:
    """Score one continuation with every method x budget not yet in ``done``; ``write(row)`` each."""
    todo = todo_of(record, methods, budgets, done)
    if not todo:
        return
    prefix = record.prefill_ids
    compactions = make_compactions(model, tok, record, prefix, todo, compaction, cache_dir, progress)
    shared = SharedPrefill(model, prefix, base, budgets, compactions=compactions)
    targets = torch.tensor(record.target_ids, device=model.device)
    feed = record.feed_ids

    t0 = time.perf_counter()
    full = shared.open(parse_method("full"), None)
    ref = teacher_forced_logprobs(model, full, feed)  # [N, V]
    full_s = time.perf_counter() - t0
    for spec, budget in todo:
        if spec.kind == "full":
            t1 = time.perf_counter()
            opened, metrics = full, continuation_metrics(ref, targets, None)
            metrics.update(kl=0.0, top1=1.0)
        else:
            opened = shared.open(spec, budget)  # compactions: fitted here, timed in compact_s
            t1 = time.perf_counter()
            logp = teacher_forced_logprobs(model, opened, feed)
            metrics = continuation_metrics(logp, targets, ref)
        row = {
            "task": record.task, "length": record.length, "index": record.index, "seed": record.seed,
            "depth": None, "method": spec.name, "budget": budget,
            "prompt_tokens": len(record.context_ids), "new_tokens": len(record.target_ids), **metrics,
            "seconds": (time.perf_counter() - t1) + (full_s if spec.kind == "full" else 0.0),
            "prefill_s": shared.prefill_s, **opened.fields,
            **{f"stats_{k}": v for k, v in opened.stats().items()},
        }
        write(row)
    if compactions is not None:
        compactions.cleanup()
