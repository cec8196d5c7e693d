"""One record of the compaction study: capture, compact with every method, measure, continue.

For a task record (context = the prefix to compact, suffix = question and answer prefix):

1. capture the reference queries of the context (prefill, repeat, self-study passes) and split
   off the held-out near queries (:func:`~.study_queries.split_queries`);
2. continue the full cache over the suffix, full's greedy answer and the far text, recording
   the far queries (:func:`~.study_queries.continue_full`);
3. for each ratio, compact every (layer, KV head) with every method from the shared fits
   (:func:`~.study_heads.compact_methods`) and measure each head (:func:`~.study_measure.measure_head`);
4. serve each method's compacted prefix (:func:`~.serve.to_cache`) and continue the record:
   KL to full over full's answer tokens (teacher-forced) and the method's greedy answer, scored
   with the task's metric.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvlocks_lab.eval.metrics import top1_agreement
from kvlocks_lab.eval.tasks import TaskRecord, score

from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.compaction.prefix import CompactedPrefix, model_info
from kvlocks.integrations.hf.compaction.passes import ReferenceConfig, reference_passes
from kvlocks.integrations.hf.compaction.serve import to_cache
from .config import StudyConfig
from .decode import continue_record, greedy, teacher_forced
from .heads import compact_methods, prepare_head
from .measure import QU_EDGES, head_queries, measure_head, qu_histogram
from .metrics import answer_kl
from .queries import continue_full, full_cache, split_queries
from .solvers import compare_capture


@dataclass
class RecordResult:
    """Rows of one record.

    Attributes
    ----------
    heads : list of dict
        One per (ratio, method, layer, head): ``task``, ``length``, ``index``, ``method``,
        ``ratio``, ``layer``, ``head`` and the fields of :func:`~.study_measure.measure_head`,
        plus ``compact_s`` (that head's own compaction time).
    records : list of dict
        One per (method, ratio) and one for ``full``: ``kl``, ``top1``, ``accuracy``,
        ``prediction``, ``compact_s`` (capture plus every head of the method), ``T``, ``t``.
    qu_hist : dict[str, list[int]]
        ``near``/``far`` histograms of q.u - 1 over every (layer, head) (``QU_EDGES``).
    qu_samples : dict[str, list[Tensor]]
        Up to 256 seeded values of q.u - 1 per (layer, head), for pooled quantiles.
    solvers : list of dict
        Bias-solver comparison rows (:func:`~.study_solvers.compare_capture`), or empty.
    """

    heads: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    qu_hist: dict[str, list[int]] = field(default_factory=dict)
    qu_samples: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {"near": [], "far": []})
    solvers: list[dict] = field(default_factory=list)


def _eos_ids(tok) -> set[int]:
    eos = {tok.eos_token_id}
    if "<|im_end|>" in tok.get_vocab():
        eos.add(tok.convert_tokens_to_ids("<|im_end|>"))
    return eos


def _sample(x: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    if x.numel() <= k:
        return x.flatten()
    rows = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(seed))[:k]
    return x.flatten()[rows]


def _prefix(made: dict, method: str, num: int, t: int, cfg, info, seconds: float) -> CompactedPrefix:
    layers = made[method]
    return CompactedPrefix(
        keys=tuple(torch.stack([h.keys for h in heads]) for heads in layers),
        values=tuple(torch.stack([h.values for h in heads]) for heads in layers),
        beta=tuple(torch.stack([h.beta for h in heads]) for heads in layers) if method == "am" else None,
        indices=tuple(torch.stack([h.indices for h in heads]) for heads in layers),
        prefix_len=num, kept=t, method=method, config=cfg, reference="{}", model=info,
        compact_seconds=seconds)


def study_record(model, tok, record: TaskRecord, cfg: StudyConfig, far_ids: list[int], *,
                 progress: Callable[[str], None] | None = None) -> RecordResult:
    """Run the study on one record (module docstring); ``far_ids`` is the far text."""
    note = progress or (lambda s: None)
    max_new = cfg.answer_budget(record.max_new_tokens)
    eos = _eos_ids(tok)
    ctx = torch.tensor([record.context_ids])  # [1, T]
    num = ctx.shape[1]
    limit = model.config.get_text_config(decoder=True).max_position_embeddings
    if num + len(record.suffix_ids) + max_new + len(far_ids) > limit:
        raise ValueError(f"record {record.task}#{record.index}: {num} context + {len(record.suffix_ids)} "
                         f"suffix + {max_new} answer + {len(far_ids)} far tokens exceed "
                         f"the model's {limit} positions; lower --far-tokens or --lengths")
    reference = ReferenceConfig(self_study_tokens=cfg.self_study_tokens)
    note("capture")
    cap = capture_queries(model, ctx, reference_passes(tok, ctx, reference),
                          max_queries=cfg.max_queries, seed=cfg.seed)
    split = split_queries(cap, cfg.heldout, cfg.max_queries, cfg.seed)
    res = RecordResult()
    if cfg.compare_solvers and record.index == 0:
        note("bias solvers")
        res.solvers = [{**r, "task": record.task}
                       for r in compare_capture(cap.keys, split.fit, cap.scales, cfg.ratios)]
    note("full")
    cont = continue_full(model, cap, record.suffix_ids, far_ids,
                         max_new_tokens=max_new, eos_ids=eos)
    full_logp = teacher_forced(model, full_cache(model, cap), record.suffix_ids, cont.answer)
    base = {"task": record.task, "length": record.length, "index": record.index}
    res.records.append(_record_row(base, "full", None, tok, record, cont.answer, eos,
                                   kl=0.0, top1=1.0, compact_s=0.0, num=num, t=num))
    made, spent = _compact_all(cap, split, cont, cfg, num, base, res, note)
    info = model_info(model, cfg.model)
    for ratio in cfg.ratios:
        t = cfg.compaction("fold", ratio).budget(num)
        for m in cfg.methods:
            note(f"r={ratio} decode {m}")
            prefix = _prefix(made[ratio], m, num, t, cfg.compaction(m, ratio), info, spent[ratio][m])
            got = continue_record(model, lambda: to_cache(model, prefix), record.suffix_ids,
                                  cont.answer, max_new_tokens=max_new, eos_ids=eos)
            row = _record_row(
                base, m, ratio, tok, record, got.tokens, eos, kl=answer_kl(full_logp, got.logp),
                top1=float(top1_agreement(full_logp, got.logp).mean()), compact_s=spent[ratio][m],
                num=num, t=t, decoded=got.decoded)
            if m == "fold" and ratio == cfg.ratios[0]:
                note(f"r={ratio} file round trip")
                row["file_roundtrip_equal"] = file_roundtrip_equal(model, prefix, record.suffix_ids,
                                                                   max_new, eos)
            res.records.append(row)
    return res


def _compact_all(cap, split, cont, cfg: StudyConfig, num: int, base: dict, res: RecordResult,
                 note) -> tuple[dict, dict]:
    """Compact and measure every (layer, KV head) at every ratio; fills ``res`` in place.

    Returns ``made[ratio][method][layer][head]`` (CompactedHead) and ``spent[ratio][method]``
    (capture plus every head's own compaction time, seconds).
    """
    made = {r: {m: [] for m in cfg.methods} for r in cfg.ratios}
    spent = {r: {m: cap.seconds for m in cfg.methods} for r in cfg.ratios}
    ccfg = cfg.compaction("fold", cfg.ratios[0])  # ratio aside, every cell shares these settings
    res.qu_hist = {"near": [0] * (len(QU_EDGES) + 1), "far": [0] * (len(QU_EDGES) + 1)}
    for layer in range(len(cap.keys)):
        note(f"layer {layer}")
        k_all, v_all, scale = cap.keys[layer].float(), cap.values[layer].float(), cap.scales[layer]
        for r in cfg.ratios:
            for m in cfg.methods:
                made[r][m].append([])
        for h in range(k_all.shape[0]):
            fit = prepare_head(k_all[h], v_all[h], split.fit[layer][h], ccfg, scale)
            hq = head_queries(k_all[h], v_all[h], split.near[layer][h], cont.far[layer][h],
                              cont.delta, scale)
            for ratio in cfg.ratios:
                mh = compact_methods(fit, ccfg.replace(ratio=ratio).budget(num), cfg.methods, ccfg)
                rows, qu = measure_head(mh.heads, hq, scale, beta_min=ccfg.beta_min,
                                        beta_max=ccfg.beta_max)
                for m in cfg.methods:
                    made[ratio][m][-1].append(mh.heads[m])
                    spent[ratio][m] += mh.seconds[m]
                    res.heads.append({**base, "method": m, "ratio": ratio, "layer": layer, "head": h,
                                      **rows[m], "compact_s": float(f"{mh.seconds[m]:.4g}")})
            # u, hence q.u, depends on the fit queries only, not on the ratio: the last one's
            seed = cfg.seed + 1000 * layer + h
            for where in ("near", "far"):
                res.qu_hist[where] = [a + b for a, b in zip(res.qu_hist[where], qu_histogram(qu[where]))]
                res.qu_samples[where].append(_sample(qu[where], 256, seed))
    return made, spent


def file_roundtrip_equal(model, prefix: CompactedPrefix, suffix_ids: list[int], max_new: int,
                         eos: set[int]) -> bool:
    """Whether the prefix saved to a file and loaded back greedy-decodes exactly the same tokens."""
    from kvlocks.compaction.cachefile import load, save

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load(save(Path(tmp) / "prefix.safetensors", prefix), model)
    a = greedy(model, to_cache(model, prefix), suffix_ids, max_new_tokens=max_new, eos_ids=eos)
    b = greedy(model, to_cache(model, loaded), suffix_ids, max_new_tokens=max_new, eos_ids=eos)
    return a == b


def _record_row(base: dict, method: str, ratio, tok, record: TaskRecord, tokens: list[int],
                eos: set[int], *, kl: float, top1: float, compact_s: float, num: int, t: int,
                decoded: bool = False) -> dict:
    text = tok.decode([x for x in tokens if x not in eos], skip_special_tokens=True)
    return {**base, "method": method, "ratio": ratio, "T": num, "t": t, "kl": float(f"{kl:.5g}"),
            "top1": top1, "accuracy": score(record, text)["score"], "prediction": text,
            "references": list(record.references), "decoded": decoded,
            "compact_s": round(compact_s, 3)}
