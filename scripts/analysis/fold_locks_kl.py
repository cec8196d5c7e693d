"""LOCKS over a folded cache against LOCKS over the full cache: KL to full and per-step diagnostics.

For a few 2K task-suite records on the bundled SmolLM2-135M, with the record's context compacted
by ``fold@RATIO`` exactly as ``kvlocks eval`` does it (:class:`RecordCompactions`):

1. **KL to full as ``kvlocks eval`` computes it** for ``fold@RATIO+locks`` at each budget: greedy
   decoding, and at the first divergence from full's answer a fork of the cache follows full's
   tokens.
2. **Teacher-forced KL** (the whole answer fed along full's tokens on one cache, no fork) for
   ``locks`` and ``oracle`` (exact per-page log-sum-exp, reads every key) at each budget over the
   full cache and over the folded cache, and for the folded cache read densely.
3. **Per-step attention diagnostics** on each cache's own dense trajectory (queries recorded at
   every decode step and layer while every page is attended): Eq. 4 score error of the page
   summaries against the exact per-page LSE, coverage (exact softmax mass in the selected pages)
   of the LOCKS and oracle selections, their output error ``||o_sel - o|| / ||o||`` against exact
   dense attention over the same cache, and the mean value norm.

Fits are kept in ``--cache-dir`` (file names as ``kvlocks eval`` writes them), so a rerun does not
refit; a 2K fold@0.5 fit takes about 5 min on one core.

    OMP_NUM_THREADS=1 nice .venv/bin/python scripts/analysis/fold_locks_kl.py \
        --records niah_single_noise:1,niah_multikey:0 --ratio 0.5 --budgets 128,256 \
        --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import kvlocks_lab.eval.runner as runner
from kvlocks.integrations.hf.compaction import serve
from kvlocks.config import LocksConfig
from kvlocks_lab.eval.compacted import CompactionSettings, RecordCompactions
from kvlocks.integrations.hf.decode import prefill, step
from kvlocks_lab.eval.metrics import kl_divergence, top1_agreement
from kvlocks_lab.eval.suite import EvalConfig
from kvlocks_lab.eval.tasks import generate
from kvlocks.integrations.hf import LocksCache
from kvlocks.scoring.reference import exact_page_lse, score_pages_from_summaries
from kvlocks.selection.selectors import LayerView, LocksSelector, OracleSelector, choose_pages

DENSE_BUDGET = 8192  # a budget above every page count here: LOCKS machinery, dense result


class Recorder:
    """A selector that records each decode step's queries and delegates to ``base``.

    Records ``(layer, n, queries [B, Hkv, G, D])``; the keys, values and summaries the step saw
    are the first ``n`` entries of the cache's store afterwards (appends never rewrite them).
    """

    def __init__(self, base) -> None:
        self.base, self.steps = base, []
        self.name, self.needs_summaries = base.name, base.needs_summaries
        self.reads_all_keys = base.reads_all_keys

    def page_scores(self, queries, view, config):
        self.steps.append((view.layer, view.keys.shape[-2], queries.detach().float().clone()))
        return self.base.page_scores(queries, view, config)


# --- decoding ------------------------------------------------------------------------------


@torch.inference_mode()
def answer_logps(model, cache, suffix: list[int], answer: list[int]) -> torch.Tensor:
    """Next-token log-probs ``[A, V]`` along ``answer`` after feeding ``suffix`` (teacher-forced)."""
    for t in suffix:
        logits = step(model, cache, t)
    out = [torch.log_softmax(logits.float(), -1)]
    for t in answer[:-1]:
        out.append(torch.log_softmax(step(model, cache, t).float(), -1))
    return torch.stack(out)


@torch.inference_mode()
def reference(model, cache, suffix: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Full's greedy answer (EOS included, as ``kvlocks eval``'s runner keeps it)."""
    for t in suffix:
        logits = step(model, cache, t)
    tokens: list[int] = []
    for i in range(max_new):
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos or i == max_new - 1:
            break
        logits = step(model, cache, tokens[-1])
    return tokens


@torch.inference_mode()
def eval_path(model, cache, suffix, ref, max_new, eos, ref_lp) -> dict:
    """KL as ``kvlocks eval`` computes it (greedy; at the first divergence from ``ref`` a fork of
    the cache is teacher-forced along ``ref``), and where the divergence was (None: never)."""
    for t in suffix:
        logits = step(model, cache, t)
    tokens, logps = runner._answer(model, cache, logits, max_new, eos, ref)
    n = min(len(logps), ref_lp.shape[0])
    lp = torch.stack(logps[:n])
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    return {"kl": float(kl_divergence(ref_lp[:n], lp).mean()), "diverged_at": diverged}


# --- per-step diagnostics -------------------------------------------------------------------


def _selected_mask(pages: torch.Tensor, n: int, s: int) -> torch.Tensor:
    """Bool ``[..., n]`` token mask of the selected pages ``[..., K]``."""
    total = -(-n // s)
    m = torch.zeros((*pages.shape[:-1], total), dtype=torch.bool)
    m.scatter_(-1, pages, True)
    return m.repeat_interleave(s, dim=-1)[..., :n]


@torch.inference_mode()
def diagnose(cache, recorder: Recorder, budgets, base: LocksConfig, scale: float) -> dict:
    """Per-step attention diagnostics of one cache along its recorded dense trajectory.

    Means over recorded steps x layers (per step: over KV heads, query heads and pages):
    ``lse_mae`` |Eq. 4 estimate - exact page LSE| over all full pages, ``lse_mae_share_weighted``
    the same weighted by the page's exact mass share; per ``SELECTOR@BUDGET``: ``coverage``,
    ``out_rel_err`` (mean and 90th percentile over KV x query heads); ``locks@B/recall_of_oracle_mass``
    (LOCKS coverage / oracle coverage per head); ``value_norm_mean``.
    """
    s = base.page_size
    acc: dict[str, list[float]] = {}

    def add(key, x):
        acc.setdefault(key, []).append(float(x))

    for layer, n, q in recorder.steps:
        store = cache.layers[layer].store
        k, v = store.keys[..., :n, :].float(), store.values[..., :n, :].float()  # [1, Hkv, n, D]
        pc = n // s
        summ = store.summaries.select_pages(slice(0, pc))
        logits = torch.einsum("bhgd,bhnd->bhgn", q, k) * scale  # [1, Hkv, G, n]
        p = torch.softmax(logits, -1)
        o = p @ v  # [1, Hkv, G, D]
        exact = exact_page_lse(q, k, s, scale=scale)  # [1, Hkv, G, Pc]
        est = score_pages_from_summaries(q, summ, scale=scale)
        share = torch.softmax(exact, -1)
        err = (est - exact).abs()
        add("lse_mae", err.mean())
        add("lse_mae_share_weighted", (err * share).sum(-1).mean())
        view = LayerView(keys=k, summaries=summ, token_mask=None, scale=scale, layer=layer)
        for b in budgets:
            cfg = base.replace(budget=b)
            covs = {}
            for name, sel in (("locks", LocksSelector()), ("oracle", OracleSelector())):
                pages = choose_pages(q, view, cfg, sel)  # [1, Hkv, K]
                m = _selected_mask(pages, n, s)[:, :, None, :]  # [1, Hkv, 1, n]
                cov = covs[name] = (p * m).sum(-1)  # [1, Hkv, G]
                ps = torch.softmax(logits.masked_fill(~m, float("-inf")), -1)
                rel = (ps @ v - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12)
                add(f"{name}@{b}/coverage", cov.mean())
                add(f"{name}@{b}/out_rel_err", rel.mean())
                add(f"{name}@{b}/out_rel_err_p90", torch.quantile(rel.flatten(), 0.9))
            add(f"locks@{b}/recall_of_oracle_mass", (covs["locks"] / covs["oracle"]).mean())
        add("value_norm_mean", v.norm(dim=-1).mean())
    return {key: sum(vals) / len(vals) for key, vals in acc.items()}


# --- one record ------------------------------------------------------------------------------


def run_record(model, tok, task: str, index: int, args, base: LocksConfig, eos: set[int]) -> dict:
    """Every measurement of one record (module docstring); one JSON-able dict."""
    record = generate(task, tok, args.length, index + 1, seed=args.seed)[index]
    ctx, suffix = record.context_ids, record.suffix_ids
    scale = model.config.head_dim ** -0.5
    t0 = time.perf_counter()
    full = LocksCache(model.config, method="locks", config=base)
    prefill(model, full, torch.tensor([ctx]))  # dense, summaries built at the end
    ref = reference(model, full.fork(method="full"), suffix, record.max_new_tokens, eos)
    ref_lp = answer_logps(model, full.fork(method="full"), suffix, ref)  # [A, V]
    settings = CompactionSettings(max_queries=args.max_queries, seed=args.seed)
    rc = RecordCompactions(model, tok, ctx, settings, cache_dir=Path(args.cache_dir),
                           tag=f"{task}-{args.length}-s{args.seed}-i{index}")  # as kvlocks eval names it
    with torch.inference_mode():
        prefix = rc.get("fold", args.ratio)
    fold = f"fold@{args.ratio:g}"
    row = {"task": task, "index": index, "context_tokens": len(ctx), "suffix_tokens": len(suffix),
           "answer_tokens": len(ref), "kept": prefix.kept, "eval_kl": {},
           "diverged_at": {}, "tf_kl": {}, "tf_top1": {}, "diag": {}}

    def locks_over_fold(sel, b):
        return serve.to_locks_cache(model, prefix, method=sel, config=base.replace(budget=b))

    for b in args.budgets:
        name = f"{fold}+locks@{b}"
        got = eval_path(model, locks_over_fold("locks", b), suffix, ref, record.max_new_tokens, eos, ref_lp)
        row["eval_kl"][name] = got["kl"]
        row["diverged_at"][name] = got["diverged_at"]

    def teacher_forced(name, cache):
        lp = answer_logps(model, cache, suffix, ref)
        row["tf_kl"][name] = float(kl_divergence(ref_lp, lp).mean())
        row["tf_top1"][name] = float(top1_agreement(ref_lp, lp).float().mean())

    teacher_forced(fold, serve.to_locks_cache(model, prefix, method="full", config=base))
    for sel in ("locks", "oracle"):
        for b in args.budgets:
            teacher_forced(f"locks@{b}" if sel == "locks" else f"oracle@{b}",
                           full.fork(method=sel, config=base.replace(budget=b)))
            teacher_forced(f"{fold}+{sel}@{b}", locks_over_fold(sel, b))
    dense = base.replace(budget=DENSE_BUDGET)
    for cname, make in (("full", lambda rec: full.fork(method=rec, config=dense)),
                        (fold, lambda rec: serve.to_locks_cache(model, prefix, method=rec, config=dense))):
        rec = Recorder(LocksSelector())
        cache = make(rec)
        answer_logps(model, cache, suffix, ref)
        row["diag"][cname] = diagnose(cache, rec, args.budgets, base, scale)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _round(x):
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _mean(rows: list[dict]) -> dict:
    """Means over records of every number under ``eval_kl``, ``tf_kl``, ``diag``."""
    def mean(dicts):
        first = dicts[0]
        if isinstance(first, dict):
            return {k: mean([d[k] for d in dicts]) for k in first}
        return _round(sum(dicts) / len(dicts))
    return {key: mean([r[key] for r in rows]) for key in ("eval_kl", "tf_kl", "diag")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", default="niah_single_noise:1,niah_multikey:0",
                    help="TASK:INDEX,... (records of kvlocks_lab.eval.tasks.generate with --seed)")
    ap.add_argument("--length", type=int, default=2048, help="record length in tokens")
    ap.add_argument("--ratio", type=float, default=0.5, help="fold's kept fraction of the context")
    ap.add_argument("--budgets", default="128,256", help="LOCKS budgets (tokens per layer and KV head)")
    ap.add_argument("--max-queries", type=int, default=4096, help="compaction reference queries per KV head")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="/tmp/fold_locks_kl_fits", help="compacted fits, kept for reruns")
    ap.add_argument("--out", required=True, help="directory for fold_locks_kl.json")
    args = ap.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    base = EvalConfig().locks_config(max(args.budgets))  # kvlocks eval's defaults
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    for item in args.records.split(","):
        task, _, idx = item.partition(":")
        rows.append(_round(run_record(model, tok, task, int(idx), args, base, eos)))
        print(json.dumps({k: rows[-1][k] for k in ("task", "index", "eval_kl", "tf_kl")}),
              flush=True)
    result = {"config": vars(args), "locks_config": repr(base), "model": "smollm2-135m", "dtype": str(model.dtype),
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "seconds": round(time.perf_counter() - t0, 1), "mean_over_records": _mean(rows), "records": rows}
    (out / "fold_locks_kl.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
