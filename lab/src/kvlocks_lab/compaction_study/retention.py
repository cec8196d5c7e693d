"""Answer retention of compacted caches on the task suite's retrieval records.

``python -m kvlocks_lab.compaction_study.retention --out DIR [--tasks ...] [--records 20]``

Per record (context = the prefix to compact, suffix = question, assistant header, answer
prefix), one capture records every reference pass a query set needs:

* ``default``: what ``kvlocks compact`` uses (context, repeat, three self-study prompts);
* ``facts``: ``default`` plus one more generic self-study prompt (:data:`FACTS_PROMPT`), which
  knows nothing of the question;
* ``question``: ``default`` plus the record's own suffix and the greedy answer to it on the
  full cache (user-supplied questions, known when compacting).

Full attention over the original context gives full's greedy answer (scored with the task's
metric) and its next-token distributions along that answer (teacher-forced). For each query
set, every layer is prepared once (:func:`kvlocks.compaction.batched.prepare_layer`) and
compacted at every ratio with the set's methods sharing their fits
(:func:`~kvlocks.compaction.batched.compact_prepared`); each prefix is served
(:func:`kvlocks.integrations.hf.compaction.serve.to_cache`) and continued as in the study: KL to full over
full's answer tokens, the method's own greedy answer and its score. ``carriers_kept``: the
share of (layer, KV head) that keep every context token of the answer (the needle's digits).

Key selections (``--selections``): ``guarded``, the library's defaults (coverage guard and value
anchor, :class:`~kvlocks.compaction.config.CompactionConfig`), ``plain``, AM's selection and
refit as published (``coverage_share=0``, ``value_anchor=0``), or ``COVERAGE:ANCHOR`` for other
values of the two; all share each layer's full pass.

Writes ``DIR/records.jsonl`` (one row per record x query set x method x ratio, plus ``full``;
a rerun skips the records already there), ``summary.json`` and ``retention.png``
(:mod:`.retention_report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from kvlocks.compaction import batched
from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.compaction.config import CompactionConfig
from kvlocks.compaction.prefix import CompactedPrefix, identity_layer, model_info
from kvlocks.integrations.hf.compaction.passes import QueryPass, ReferenceConfig, reference_passes
from kvlocks.integrations.hf.compaction.serve import to_cache
from kvlocks.hybrid import layer_windows
from kvlocks_lab.eval.metrics import top1_agreement
from kvlocks_lab.eval.tasks import generate, score

from .decode import continue_record, greedy, teacher_forced
from .metrics import answer_kl
from .queries import full_cache

FACTS_PROMPT = "List every number, code and name stated in the text above."
QUERY_SETS = ("default", "facts", "question")
SELECTIONS = {"guarded": {}, "plain": {"coverage_share": 0.0, "value_anchor": 0.0}}
_DEFAULT_PASSES = ("context", "repeat", "self_study_0", "self_study_1", "self_study_2")


def selection_fields(name: str) -> dict:
    """CompactionConfig fields of a ``--selections`` entry (module docstring)."""
    if name in SELECTIONS:
        return SELECTIONS[name]
    try:
        cover, anchor = (float(x) for x in name.split(":"))
    except ValueError:
        raise ValueError(f"selection {name!r}: allowed {tuple(SELECTIONS)} or COVERAGE:ANCHOR "
                         "(two numbers, e.g. 0.25:0.01)") from None
    return {"coverage_share": cover, "value_anchor": anchor}


def _eos(tok) -> set[int]:
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    return eos


def carrier_positions(tok, record) -> list[int] | None:
    """Context token positions covering the asked answer (``references[0]``) in the context.

    None when the context's own tokenization cannot be matched (then no diagnostic).
    """
    ref = record.references[0]
    at = record.context_text.rfind(ref)
    if at < 0:
        return None
    enc = tok(record.context_text, add_special_tokens=False, return_offsets_mapping=True)
    end = at + len(ref)
    pos = [i for i, (a, b) in enumerate(enc.offset_mapping) if a < end and b > at]
    last = max(pos, default=len(record.context_ids))  # the ids must agree up to the answer
    if last >= len(record.context_ids) or list(enc.input_ids[:last + 1]) != list(record.context_ids[:last + 1]):
        return None
    return pos


def record_passes(tok, record, reference: ReferenceConfig, answer: list[int],
                  sets: tuple[str, ...]) -> list[QueryPass]:
    """The reference passes of ``default`` plus those the query sets ``sets`` add."""
    ctx = torch.tensor([record.context_ids])
    passes = reference_passes(tok, ctx, reference)
    if "facts" in sets:
        only = dataclasses.replace(reference, repeat=False, self_study=(FACTS_PROMPT,))
        passes.append(dataclasses.replace(reference_passes(tok, ctx, only)[0], name="facts"))
    if "question" in sets:  # the question and full's answer to it (teacher-forced, no decode)
        passes.append(QueryPass("question", torch.tensor([list(record.suffix_ids) + answer[:-1]])))
    return passes


def _prefix(layers: list[dict], method: str, num: int, t: int, cfg, info, windows=None) -> CompactedPrefix:
    return CompactedPrefix(windows=windows if windows and any(windows) else None,
        keys=tuple(x["keys"] for x in layers), values=tuple(x["values"] for x in layers),
        beta=tuple(x["beta"] for x in layers) if method == "am" else None,
        indices=tuple(x["indices"] for x in layers), prefix_len=num, kept=t, method=method,
        config=cfg.replace(method=method), reference="{}", model=info)


def _kept_share(layers: list[dict], carriers: list[int] | None, windows) -> float | None:
    """Share of the compacted (global) layers' KV heads that kept every carrier token."""
    if not carriers:
        return None
    need = torch.tensor(carriers)
    hits = [bool(torch.isin(need, x["indices"][h].cpu()).all()) for x, w in zip(layers, windows) if w is None
            for h in range(x["indices"].shape[0])]
    return sum(hits) / len(hits)


def study_record(model, tok, record, args, info) -> list[dict]:
    """Every row of one record (module docstring)."""
    eos, num = _eos(tok), len(record.context_ids)
    max_new = record.max_new_tokens
    reference = ReferenceConfig(self_study_tokens=args.self_study_tokens)
    base = {"task": record.task, "length": record.length, "index": record.index, "T": num}
    # full attention over the original context: a bare prefill gives its cache
    start = time.perf_counter()
    bare = capture_queries(model, torch.tensor([record.context_ids]), [], max_queries=1, seed=0)
    answer = greedy(model, full_cache(model, bare), record.suffix_ids, max_new_tokens=max_new, eos_ids=eos)
    full_logp = teacher_forced(model, full_cache(model, bare), record.suffix_ids, answer)
    text = tok.decode([x for x in answer if x not in eos], skip_special_tokens=True)
    rows = [{**base, "queries": None, "method": "full", "ratio": None, "t": num, "kl": 0.0, "top1": 1.0,
             "accuracy": score(record, text)["score"], "prediction": text, "carriers_kept": 1.0,
             "references": list(record.references), "seconds": round(time.perf_counter() - start, 2)}]
    start = time.perf_counter()
    cap = capture_queries(model, torch.tensor([record.context_ids]),
                          record_passes(tok, record, reference, answer, args.queries),
                          max_queries=args.max_queries, seed=args.seed)
    capture_s = time.perf_counter() - start
    carriers = carrier_positions(tok, record)
    windows = layer_windows(model.config)
    cfg = CompactionConfig(max_queries=args.max_queries, seed=args.seed)
    for qs in args.queries:
        sub = cap.only(list(_DEFAULT_PASSES) + ([] if qs == "default" else [qs]))
        methods = tuple(args.methods) if qs == "default" else tuple(args.query_methods)
        sels = {name: cfg.replace(**selection_fields(name)) for name in args.selections}
        made = {(sel, r): {m: [] for m in methods} for sel in sels for r in args.ratios}
        start = time.perf_counter()
        dev = model.device  # the fits run where the model does
        for layer, w in enumerate(windows):
            if w is not None:  # a hybrid model's sliding layer: its last W - 1 tokens, exactly
                for (sel, r), by_method in made.items():
                    for m in methods:
                        by_method[m].append(dict(zip(("keys", "values", "beta", "indices"), identity_layer(
                            sub.keys[layer], sub.values[layer], m, first=max(0, num - w + 1)))))
                continue
            question = None if sub.questions is None else sub.questions[layer].to(dev)
            fit = batched.prepare_layer(sub.keys[layer].to(dev), sub.values[layer].to(dev),
                                        sub.queries[layer].to(dev), cfg, sub.scales[layer], question=question)
            for sel, scfg in sels.items():
                f = fit if scfg.coverage_share > 0 else dataclasses.replace(fit, coverage=None)
                for r in args.ratios:
                    for m, out in batched.compact_prepared(f, scfg.replace(ratio=r).budget(num), methods,
                                                           scfg).items():
                        made[(sel, r)][m].append(out)
        fit_s = time.perf_counter() - start
        for (sel, r), by_method in made.items():
            t = cfg.replace(ratio=r).budget(num)
            for m in methods:
                prefix = _prefix(by_method[m], m, num, t, sels[sel], info, windows)
                got = continue_record(model, lambda: to_cache(model, prefix), record.suffix_ids, answer,
                                      max_new_tokens=max_new, eos_ids=eos)
                text = tok.decode([x for x in got.tokens if x not in eos], skip_special_tokens=True)
                rows.append({**base, "queries": qs, "selection": sel, "method": m, "ratio": r, "t": t,
                             "kl": float(f"{answer_kl(full_logp, got.logp):.5g}"),
                             "top1": float(top1_agreement(full_logp, got.logp).mean()),
                             "accuracy": score(record, text)["score"], "prediction": text,
                             "carriers_kept": _kept_share(by_method[m], carriers, windows),
                             "references": list(record.references),
                             "capture_s": round(capture_s, 2), "fits_s": round(fit_s, 2)})
    return rows


def _done(path: Path) -> set[tuple]:
    if not path.exists():
        return set()
    return {(r["task"], r["length"], r["index"]) for r in map(json.loads, path.read_text().splitlines())
            if r["method"] == "full"}


def run(args) -> None:
    from kvlocks.models import load
    from .retention_report import write_summary

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load(args.model, device=args.device)
    info = model_info(model, args.model)
    path = out / "records.jsonl"
    done = _done(path)
    (out / "run.json").write_text(json.dumps({"args": vars(args)}, indent=1, default=list))
    for i in range(args.records):
        for task in args.tasks:
            record = generate(task, tok, args.length, i + 1, seed=args.seed)[i]
            if (record.task, record.length, record.index) in done:
                continue
            start = time.perf_counter()
            rows = study_record(model, tok, record, args, info)
            with open(path, "a") as fh:
                for row in rows:
                    fh.write(json.dumps(row) + "\n")
            print(f"{task}#{i}: {time.perf_counter() - start:.0f} s, full "
                  f"{rows[0]['accuracy']:.0f}", flush=True)
    write_summary(out)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", type=_names, default=["niah_single_noise", "niah_single_text"])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--records", type=int, default=20, help="records per task")
    p.add_argument("--ratios", type=_floats, default=[0.5, 0.25, 0.1, 0.05])
    p.add_argument("--methods", type=_names, default=["am", "fold", "drop", "drop_refit", "rank1"],
                   help="methods with the default queries")
    p.add_argument("--queries", type=_names, default=list(QUERY_SETS), help=f"subset of {QUERY_SETS}")
    p.add_argument("--query-methods", type=_names, default=["fold"],
                   help="methods with the other query sets")
    p.add_argument("--selections", type=_names, default=list(SELECTIONS),
                   help=f"key selections and refits compared: {tuple(SELECTIONS)} or COVERAGE:ANCHOR (module docstring)")
    p.add_argument("--max-queries", type=int, default=4096)
    p.add_argument("--self-study-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model, the capture and the fits)")
    p.add_argument("--rebuild", action="store_true", help="only summary.json and the plot again")
    args = p.parse_args(argv)
    if "default" not in args.queries or any(q not in QUERY_SETS for q in args.queries):
        p.error(f"--queries must include 'default' and be a subset of {QUERY_SETS}")
    try:
        if not args.selections:
            raise ValueError("--selections is empty")
        for name in args.selections:
            CompactionConfig(**selection_fields(name))
    except ValueError as exc:
        p.error(str(exc))
    if args.rebuild:
        from .retention_report import write_summary
        write_summary(Path(args.out))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
