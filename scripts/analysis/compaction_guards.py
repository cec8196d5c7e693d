"""Why compaction loses planted facts, and what the coverage guard and the value anchor cost.

Two measurements on the bundled model, default reference queries (docs/compaction.md, "Keys no
reference query reads"):

    # carrier survival: share of (layer, KV head) keeping every context token of the answer,
    # per key score (RMS attention weight, max weight, ridge leverage, RMS with a leverage guard)
    python scripts/analysis/compaction_guards.py carriers --tasks niah_single_text,niah_single_noise \
        --records 2 --length 2048 --out DIR
    # held-out output error of fold over a prose prefix, coverage_share x value_anchor x ratio
    python scripts/analysis/compaction_guards.py heldout --tokens 2048 --ratios 0.5,0.25,0.1 --out DIR

``carriers`` writes ``DIR/carriers.jsonl`` (one row per record); ``heldout`` writes
``DIR/heldout.jsonl`` (one row per setting: the median and mean over (layer, KV head) of
``mean_j ||o_j - o*_j|| / mean_j ||o*_j||`` on the queries of 512 prose tokens after the prefix,
never fitted; the error of ``kvlocks_lab.bench.compaction_speed``). One CPU thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from kvlocks.compaction import batched, exact_attention
from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.compaction.config import CompactionConfig
from kvlocks.integrations.hf.compaction.passes import QueryPass, ReferenceConfig, reference_passes
from kvlocks.compaction.select import coverage_scores, guarded_top_t, guard_slots

RULES = ("rms", "max", "leverage", "rms+leverage_0.25", "rms+leverage_0.5")


def _kept(idx: torch.Tensor, need: torch.Tensor) -> list[bool]:
    return [bool(torch.isin(need, idx[h]).all()) for h in range(idx.shape[0])]


def carriers(args, model, tok) -> None:
    from kvlocks_lab.compaction_study.retention import carrier_positions
    from kvlocks_lab.eval.tasks import generate

    out = Path(args.out) / "carriers.jsonl"
    with open(out, "w") as fh:
        for i in range(args.records):
            for task in args.tasks:
                rec = generate(task, tok, args.length, i + 1, seed=0)[i]
                pos = carrier_positions(tok, rec)
                if not pos:
                    continue
                ctx = torch.tensor([rec.context_ids])
                num = ctx.shape[1]
                cap = capture_queries(model, ctx, reference_passes(tok, ctx, ReferenceConfig()),
                                      max_queries=4096, seed=0)
                need, hits = torch.tensor(pos), {}
                for layer in range(len(cap.keys)):
                    k = cap.keys[layer].float()
                    q = batched.subsample_rows(cap.queries[layer].float(), 4096, 0)
                    w = torch.softmax(q @ k.transpose(1, 2) * cap.scales[layer], dim=-1)  # [H, n, T]
                    score = {"rms": w.pow(2).mean(1).sqrt(), "max": w.amax(1), "leverage": coverage_scores(k)}
                    for r in args.ratios:
                        t = max(1, round(r * num))
                        for rule in RULES:
                            if "+" in rule:
                                share = float(rule.rsplit("_", 1)[1])
                                idx = guarded_top_t(score["rms"], [(score["leverage"], guard_slots(t, share))], t)
                            else:
                                idx = guarded_top_t(score[rule], [], t)
                            hits.setdefault(f"{rule}@{r:g}", []).extend(_kept(idx, need))
                row = {"task": task, "index": i, "T": num, "carriers": len(pos),
                       **{key: round(sum(v) / len(v), 4) for key, v in hits.items()}}
                fh.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def heldout(args, model, tok) -> None:
    import kvlocks.compaction as lib
    from kvlocks_lab.bench.compaction_speed import capture, prose_ids

    ids = prose_ids(tok, args.tokens)
    held = QueryPass("heldout", prose_ids(tok, 512, skip=args.tokens))
    cfg0 = CompactionConfig(coverage_share=max(args.coverage))
    cap, _ = capture(lib, model, tok, ids, cfg0, ReferenceConfig(), extra=[held])
    q_eval = cap.by_pass["heldout"]
    sub = cap.only([n for n in cap.by_pass if n != "heldout"])
    grid = [(c, a, r) for c in args.coverage for a in args.anchor for r in args.ratios]
    errs: dict = {g: [] for g in grid}
    for i in range(len(sub.keys)):
        k, v, s = sub.keys[i].float(), sub.values[i].float(), sub.scales[i]
        fit = batched.prepare_layer(k, v, sub.queries[i], cfg0, s)
        full = [exact_attention(q_eval[i][h], k[h], v[h], scale=s)[0] for h in range(k.shape[0])]
        for c, a, r in grid:
            cfg = CompactionConfig(coverage_share=c, value_anchor=a, ratio=r)
            f = fit if c > 0 else dataclasses.replace(fit, coverage=None)
            got = batched.compact_prepared(f, cfg.budget(args.tokens), ("fold",), cfg)["fold"]
            for h, ref in enumerate(full):
                o, _ = exact_attention(q_eval[i][h], got["keys"][h], got["values"][h], scale=s)
                errs[(c, a, r)].append(float((o - ref).norm(dim=-1).mean() / ref.norm(dim=-1).mean()))
    with open(Path(args.out) / "heldout.jsonl", "w") as fh:
        for (c, a, r), e in errs.items():
            row = {"tokens": args.tokens, "coverage_share": c, "value_anchor": a, "ratio": r,
                   "median": round(statistics.median(e), 5), "mean": round(statistics.fmean(e), 5)}
            fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("carriers", "heldout"))
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", type=lambda x: x.split(","), default=["niah_single_text", "niah_single_noise",
                                                                      "niah_multikey", "passkey"])
    p.add_argument("--records", type=int, default=1, help="records per task (carriers)")
    p.add_argument("--length", type=int, default=2048, help="record length (carriers)")
    p.add_argument("--tokens", type=int, default=2048, help="prose prefix length (heldout)")
    p.add_argument("--ratios", type=_floats, default=[0.5, 0.25, 0.1])
    p.add_argument("--coverage", type=_floats, default=[0.0, 0.1, 0.25], help="coverage shares (heldout)")
    p.add_argument("--anchor", type=_floats, default=[0.0, 1e-3, 1e-2], help="value anchors (heldout)")
    args = p.parse_args(argv)
    from kvlocks.models import load

    torch.set_num_threads(1)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model, tok = load("smollm2-135m")
    (carriers if args.what == "carriers" else heldout)(args, model, tok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
