"""Where ``locks_centroid``'s page choices leave the exact oracle's, selection by selection.

Decodes task records with ``full`` and ``locks_centroid`` through the task-suite runner (fp32,
CPU) and, at every selection the centroid mode makes (decode step x layer x KV head), compares
its top k - sink - recent pages with the exact oracle's (every full page's exact per-head
log-sum-exp, the same GQA combine) and with the oracle's choice among the centroid candidates
only. Prints counts as JSON: ``oracle_outside_candidates`` (oracle pages the candidates miss),
``chosen_differs_from_oracle`` and ``chosen_differs_from_oracle_on_candidates`` (pages the mode
swaps although the oracle's page was a candidate: the combine's normalisers, which take the
centroid estimates of the pages that are not candidates).

    python scripts/analysis/centroid_step_trace.py TASK OUT [--length 8192] [--budget 128] [--first 2 --samples 3]
"""
import argparse
import collections
import json
from pathlib import Path

import torch
import kvlocks.selection.selectors as sel
from kvlocks.selection.rerank import candidate_lse, forced_pages, pick_candidates
from kvlocks.scoring.reference import combine_group
from kvlocks_lab.eval.suite import EvalConfig, run_eval

orig = sel.rerank_ranking
stats = collections.Counter()

def wrapped(queries, keys, scores, ranking, config, *, scale, total_pages, token_mask=None, sink_start=None):
    out = orig(queries, keys, scores, ranking, config, scale=scale, total_pages=total_pages, token_mask=token_mask,
               sink_start=sink_start)
    if config.rerank_scores != "centroid":
        return out
    pc = scores.shape[-1]
    k2 = config.pages_per_step - config.sink_pages - config.recent_pages
    m = config.rerank_candidates(pc)
    forced = forced_pages(total_pages, config, sink_start).to(ranking.device)
    forced = forced.expand(*ranking.shape[:-1], forced.shape[-1])
    pick, cand = pick_candidates(ranking, forced, m)
    allp = torch.arange(pc, device=ranking.device).expand(*ranking.shape[:-1], pc)
    exact = candidate_lse(queries, keys, allp, config.page_size, scale=scale, token_mask=token_mask)
    orank = combine_group(exact, config.combine)
    orank = torch.where(torch.isneginf(pick), float("-inf"), orank)  # forced/empty out, as pick
    top_o = torch.topk(orank, k2, dim=-1).indices
    top_c = torch.topk(torch.where(torch.isneginf(pick), float("-inf"), out.float()), k2, dim=-1).indices
    cmask = torch.zeros_like(orank, dtype=torch.bool).scatter_(-1, cand, True)
    top_oc = torch.topk(torch.where(cmask, orank, float("-inf")), k2, dim=-1).indices
    for idx in range(top_o.reshape(-1, k2).shape[0]):
        o, c, oc = (set(t.reshape(-1, k2)[idx].tolist()) for t in (top_o, top_c, top_oc))
        cm = cmask.reshape(-1, pc)[idx]
        stats["rows"] += 1
        stats["oracle_pages"] += k2
        stats["oracle_outside_candidates"] += sum(1 for p in o if not cm[p])
        stats["chosen_differs_from_oracle"] += len(o - c)
        stats["chosen_differs_from_oracle_on_candidates"] += len(oc - c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task")
    ap.add_argument("out", type=Path)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--first", type=int, default=2)
    ap.add_argument("--samples", type=int, default=3)
    args = ap.parse_args()
    from kvlocks.models import load

    sel.rerank_ranking = wrapped
    model, tok = load("smollm2-135m")
    cfg = EvalConfig(tasks=(args.task,), lengths=(args.length,), budgets=(args.budget,),
                     methods=("full", "locks_centroid"), samples=args.samples, first_sample=args.first)
    run_eval(cfg, args.out, model=model, tok=tok, progress=False)
    print(json.dumps(dict(stats)))


if __name__ == "__main__":
    main()
