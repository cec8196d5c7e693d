"""Kernel benchmark behind ``kvlocks bench kernels --out DIR``: decode-step kernels on one layer.

For each model shape, context, batch: dense SDPA, the dense split-KV kernel, and the LOCKS step
(score, select, attend, and the three together), each timed as CUDA-graph replays with CUDA
events (median of ``replays``), after warm-up, rotating over input sets whose combined size is
``l2_multiple`` times the L2 cache, so L2 does not serve them. Plus ``build``: summaries of
every page of the context, for every layer of the model (batch 1). Bytes are counted as what
each kernel must read (see docs/kernels.md); ``pct_copy_bw`` compares the achieved rate with a
device-to-device copy (read + write bytes) measured in the same run.

The LOCKS step is the decode plan's: ``locks_score`` is the score kernel alone and ``locks_select``
the fused combine + selection (:mod:`kvlocks.selection.fused`, which reads the per-head scores).
``locks_attend`` is the split-KV attention over the chosen pages. At the largest context both
selection paths are also timed as ``x_select_unfused`` (the combine pass + the two-launch
selection) and ``x_select_fused``, and the score kernels pinned (``x_score_mma``, ``x_score_packed``).
``centroid_score`` and ``centroid_c16_total`` / ``centroid_c8_total`` are the reduced-read mode
``locks_centroid`` (`LocksConfig.rerank_scores = "centroid"`, :mod:`kvlocks.scoring.triton_centroid`): the centroid score kernel alone,
and the whole step with 16 or 8 times (k - 2) candidates re-ranked exactly.

Writes ``DIR/summary.json`` (config, device, versions, copy bandwidth, rows) and
``DIR/rows.jsonl`` (one record per measurement, appended as it is made).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlocks import env
from kvlocks.cache.layout import SummaryStore
from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.plan import DecodePlan
from kvlocks_lab.bench.kernels_centroid import centroid_bytes, centroid_methods, centroid_parts
from kvlocks_lab.bench.kernels_timing import _timer, copy_bandwidth  # noqa: F401 (copy_bandwidth: probes)

log = logging.getLogger(__name__)

SHAPES = {  # Hkv, G, D, layers
    "llama3-8b": (8, 4, 128, 32),
    "glm4-9b-1m": (4, 8, 128, 40),
}
# score-kernel variants measured beside the (autotuned) default at the largest context, batch 1
# the three-dot kernel beside the default (which is the packed kernel for G <= 4 on CUDA)
SCORE_VARIANTS = {"x_score_mma": "mma", "x_score_packed": "packed"}  # KernelOptions.score_kernel
METHODS = ("dense_sdpa", "dense_splitk", "locks_score", "locks_select", "locks_attend", "locks_total", "build")


@dataclass(frozen=True, kw_only=True)
class KernelBenchConfig:
    """What to measure. Defaults are the issue's grid; ``smoke`` shrinks it for a CPU dry run."""

    shapes: tuple[str, ...] = tuple(SHAPES)
    contexts: tuple[int, ...] = (16384, 65536, 262144, 1048576)
    batches: tuple[int, ...] = (1, 4, 16)
    budget: int = 2048
    page_size: int = 16
    replays: int = 15
    min_graph_ms: float = 3.0
    l2_multiple: float = 3.0
    mem_limit_gib: float = 100.0
    max_build_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        for s in self.shapes:
            if s not in SHAPES:
                raise ValueError(f"KernelBenchConfig.shapes: {s!r} not in {tuple(SHAPES)}")
        for n in self.contexts:
            if n < self.budget or n % self.page_size:
                raise ValueError(f"KernelBenchConfig.contexts: {n} must be a multiple of page_size >= budget")
        if self.replays < 3:
            raise ValueError(f"KernelBenchConfig.replays={self.replays}: must be >= 3")


def _random_store(num_pages, hkv, d, lcfg, device, gen):
    st = SummaryStore.empty(num_pages, hkv, d, lcfg, device=device)
    st.basis.random_(0, 256, generator=gen)
    for t in (st.coef, st.centroid):
        t.random_(-127, 128, generator=gen)
    for t in (st.basis_scale, st.coef_scale, st.centroid_scale):
        t.uniform_(0.01, 0.05, generator=gen)
    return st


class _Case:
    """Inputs of one (shape, context, batch): a paged cache of ``n_rot`` disjoint page sets."""

    def __init__(self, shape, n, bsz, n_rot, cfg, device, gen):
        hkv, g, d, _ = SHAPES[shape]
        s = cfg.page_size
        self.hkv, self.g, self.d, self.n, self.bsz, self.n_rot = hkv, g, d, n, bsz, n_rot
        self.p = p = n // s
        pages = n_rot * bsz * p
        self.lcfg = LocksConfig(page_size=s, budget=cfg.budget)
        bf = dict(dtype=torch.bfloat16, device=device)
        self.kc = torch.empty(pages, s, hkv, d, **bf).normal_(generator=gen)  # random, non-zero
        self.vc = torch.empty(pages, s, hkv, d, **bf).normal_(generator=gen)
        self.store = _random_store(pages, hkv, d, self.lcfg, device, gen)
        base = torch.arange(bsz * p, dtype=torch.int32, device=device).view(bsz, p)
        self.tables = [base + r * bsz * p for r in range(n_rot)]
        self.q = [torch.empty(bsz, hkv * g, d, **bf).normal_(generator=gen) for _ in range(n_rot)]
        self.seq = torch.full((bsz,), n, dtype=torch.int32, device=device)

    def dense_kv(self, r):
        blk = slice(r * self.bsz * self.p, (r + 1) * self.bsz * self.p)
        k = self.kc[blk].view(self.bsz, self.n, self.hkv, self.d).transpose(1, 2)  # [B, Hkv, N, D] view
        v = self.vc[blk].view(self.bsz, self.n, self.hkv, self.d).transpose(1, 2)
        return k, v


def _bytes(case, k_pages):
    """Bytes each method must read (one layer, one step). ``locks_select`` (fused) reads the per-head
    scores."""
    rows = case.bsz * case.hkv
    kv_page = case.lcfg.page_size * case.d * 2 * 2  # K + V, bf16
    summ = rows * case.p * case.store.bytes_per_page_head()
    select = rows * case.p * 4 * case.g
    attend = rows * k_pages * kv_page
    variants = {name: summ for name in SCORE_VARIANTS}
    return {**variants, "x_score_combine": rows * case.p * 4 * (case.g + 1), "x_launch_floor": 4,
            "x_select_unfused": rows * case.p * 4 * (case.g + 1), "x_select_ranked": rows * case.p * 4,
            "x_select_fused": rows * case.p * 4 * case.g,
            "x_splitk_default": rows * case.p * kv_page,
            "dense_sdpa": rows * case.p * kv_page, "dense_splitk": rows * case.p * kv_page, "locks_score": summ,
            "locks_select": select, "locks_attend": attend, "locks_total": summ + select + attend,
            "x_locks_rerank_total": summ + select + rows * rerank_pages(case) * case.lcfg.page_size * case.d * 2
            + attend,
            **centroid_bytes(case, rows, select, attend)}


RERANK = 4  # the candidate multiple x_locks_rerank_total measures (kvlocks.integrations.hf.DEFAULT_RERANK)


def rerank_pages(case) -> int:
    """Pages whose keys the re-rank reads per row: the candidates and the forced full pages."""
    c = dataclasses.replace(case.lcfg, rerank=RERANK)
    return min(case.p, c.rerank_candidates(case.p) + c.sink_pages + c.recent_pages)


def _methods(case, device):
    """Callables ``fn(rotation)`` per method, sharing one plan's buffers."""
    from kvlocks.attention.triton import attention_workspace, identity_pages, paged_decode
    from kvlocks.scoring.triton import score_pages_paged
    from kvlocks.selection.fused import fused_workspace, rank_and_select
    from kvlocks.selection.triton import select_pages_paged, select_workspace

    plan = DecodePlan(batch=case.bsz, num_kv_heads=case.hkv, group=case.g, head_dim=case.d, max_pages=case.p,
                      config=case.lcfg, dtype=torch.bfloat16, device=device, backend="triton")
    c, k = case.lcfg, case.lcfg.pages_per_step
    # the whole step with the exact re-rank of RERANK x (k - 2) candidates (LocksConfig.rerank)
    rerank_plan = DecodePlan(batch=case.bsz, num_kv_heads=case.hkv, group=case.g, head_dim=case.d,
                             max_pages=case.p, config=dataclasses.replace(c, rerank=RERANK), dtype=torch.bfloat16,
                             device=device, backend="triton")
    sel = dict(page_size=c.page_size, k=k, sink_pages=c.sink_pages, recent_pages=c.recent_pages)
    unfused_ws = select_workspace(case.bsz, case.hkv, case.p, k, device)
    fused_ws = fused_workspace(case.bsz, case.hkv, case.p, k, device)
    rankings, lists, scored = [], [], []
    sw = plan.score_ws
    for r in range(case.n_rot):  # realistic inputs for select/attend: the real score/select outputs
        _, _, rk = score_pages_paged(case.q[r], case.store, case.tables[r], case.seq, workspace=sw)
        rankings.append(rk.clone())
        scored.append(dataclasses.replace(sw, **{n: getattr(sw, n).clone() for n in ("scores", "stats", "lse",
                                                                                      "ranking")}))
        lists.append(select_pages_paged(rk, case.seq, workspace=unfused_ws, **sel).clone())
    ident = identity_pages(case.bsz, case.hkv, case.p, device)
    dense_ws = attention_workspace(case.bsz, case.hkv * case.g, case.d, case.p, case.bsz * case.hkv,
                                   torch.bfloat16, device)

    def sdpa(r):
        k_, v_ = case.dense_kv(r)
        return F.scaled_dot_product_attention(case.q[r].view(case.bsz, case.hkv, case.g, case.d), k_, v_)

    from kvlocks.scoring.triton_combine import combine_launch

    empty = torch.empty(1, device=device)
    variants = {name: KernelOptions(score_kernel=kernel) for name, kernel in SCORE_VARIANTS.items()}
    # dense_splitk: the split-KV kernel's fastest launch for this case (kvlocks.attention.tune, as the
    # e2e bench and the engine use it); x_splitk_default keeps the default launch for comparison
    case.dense_launch = None
    if device.type == "cuda":
        from kvlocks.attention.tune import fastest_dense

        tuned = fastest_dense(case.q[0], [case.kc], [case.vc], case.tables[0], case.seq, ident)
        default_ws, dense_ws = dense_ws, tuned.workspace
        case.dense_launch = {"label": tuned.launch.label(), "splits": dense_ws.splits,
                             "candidates_us": tuned.times_us}
    else:
        default_ws = dense_ws
    def unfused(r):  # the combine pass, then the two-launch selection
        combine_launch(sw, case.seq, case.hkv, case.g, case.p, c.page_size, c.combine)
        return select_pages_paged(sw.ranking, case.seq, workspace=unfused_ws, **sel)

    extras = {  # diagnostics for docs/kernels.md: the combine pass alone, one empty launch, variants
        "x_score_combine": lambda r: combine_launch(sw, case.seq, case.hkv, case.g, case.p, c.page_size,
                                                    c.combine),
        "x_select_unfused": unfused,
        "x_select_fused": lambda r: rank_and_select(scored[r], case.seq, combine=c.combine, workspace=fused_ws,
                                                    **sel),
        "x_select_ranked": lambda r: select_pages_paged(rankings[r], case.seq, workspace=unfused_ws, **sel),
        "x_launch_floor": lambda r: empty.add_(1.0),
        "x_locks_rerank_total": lambda r: rerank_plan.run(case.q[r], case.kc, case.vc, case.store, case.tables[r],
                                                          case.seq),
        **{name: (lambda r, o=o: score_pages_paged(case.q[r], case.store, case.tables[r], case.seq, workspace=sw,
                                                   options=o))
           for name, o in variants.items()},
        "x_splitk_default": lambda r: paged_decode(case.q[r], case.kc, case.vc, case.tables[r], case.seq, ident,
                                                   workspace=default_ws),
        **centroid_parts(case, device),
    }
    return extras, {
        **centroid_methods(case, device),
        "dense_sdpa": sdpa,
        "dense_splitk": lambda r: paged_decode(case.q[r], case.kc, case.vc, case.tables[r], case.seq, ident,
                                               workspace=dense_ws),
        "locks_score": lambda r: score_pages_paged(case.q[r], case.store, case.tables[r], case.seq,
                                                   workspace=sw, rank=False),
        "locks_select": lambda r: rank_and_select(scored[r], case.seq, combine=c.combine, workspace=plan.select_ws,
                                                  **sel),
        "locks_attend": lambda r: paged_decode(case.q[r], case.kc, case.vc, case.tables[r], case.seq, lists[r],
                                               workspace=plan.attend_ws),
        "locks_total": lambda r: plan.run(case.q[r], case.kc, case.vc, case.store, case.tables[r], case.seq),
    }


def _score_kernel_name(device) -> str:
    """Which kernel ``locks_score`` runs here: the CUDA kernel, or Triton's (with the reason)."""
    from kvlocks.scoring import cuda_mma

    reason = cuda_mma.unavailable_reason(device)
    return "cuda_mma (kvlocks/scoring/score_mma.cu)" if reason is None else f"triton ({reason})"


def _tuned_score_config() -> str | None:
    """The launch configurations the score kernels' autotuners chose last (None on the CPU)."""
    from kvlocks.scoring import triton as mma
    from kvlocks.scoring import triton_packed as packed

    best = {name: str(c) for name, c in (("mma", mma.tuned_launch()), ("packed", packed.tuned_launch()))
            if c is not None}
    return str(best) if best else None


def _tuned_build_config() -> str | None:
    """The bulk build's solver and launch: the fixed one-sided launch, or the configuration the
    autotuner chose last for the lean solver (None on the CPU or before a build)."""
    from kvlocks.summary import triton as bt

    solver = bt.resolve_solver("auto")
    if solver == "onesided":
        return f"onesided {bt.ONESIDED_LAUNCH}"
    best = bt.tuned_launch()
    return None if best is None else f"{solver} {best}"


def _n_rot(shape, n, bsz, cfg, l2_bytes):
    hkv, _, d, _ = SHAPES[shape]
    p = n // cfg.page_size
    per_rot_summ = bsz * hkv * p * 818
    per_rot_all = bsz * hkv * p * (cfg.page_size * d * 4 + 818)
    n_rot = max(1, min(32, math.ceil(cfg.l2_multiple * l2_bytes / per_rot_summ)))
    while n_rot > 1 and n_rot * per_rot_all > cfg.mem_limit_gib * 2**30:
        n_rot -= 1
    return n_rot, n_rot * per_rot_all <= cfg.mem_limit_gib * 2**30


def _time_build(case, layers, cfg, device):
    """Whole-model build at batch 1: ``layers`` launches over every page of the context.

    Returns (total us, per-layer us, extrapolated): a subset of pages is built first; when a
    layer or the whole model would take over ``max_build_s``, the time is scaled from the largest
    measured run instead (noted in the row)."""
    from kvlocks.summary.triton import build_pages

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(ids, reps=1):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            build_pages(case.kc, case.store, ids)
        sync()
        return time.perf_counter() - t0

    ids = torch.arange(case.p, dtype=torch.int32, device=device)  # the first sequence's pages
    sub = ids[: min(case.p, 4096)]
    timed(sub)  # compile
    t_sub = timed(sub)
    per_layer = t_sub * case.p / sub.numel()
    if per_layer > cfg.max_build_s:
        return per_layer * layers * 1e6, per_layer * 1e6, True
    per_layer = timed(ids)
    if per_layer * layers > cfg.max_build_s:
        return per_layer * layers * 1e6, per_layer * 1e6, True
    return timed(ids, layers) * 1e6, per_layer * 1e6, False


def run_kernels_bench(out_dir, config: KernelBenchConfig | None = None, *, device=None) -> dict:
    """Run the benchmark grid and write ``summary.json`` + ``rows.jsonl`` under ``out_dir``."""
    import triton

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = config or KernelBenchConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = (out / "rows.jsonl").open("w")
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    l2 = getattr(props, "L2_cache_size", 50 << 20) if props else 0  # no rotation on the CPU
    copy_gbps = copy_bandwidth(device)
    log.info("copy bandwidth %s GB/s", copy_gbps)
    timer = _timer(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    rows, errors = [], []

    def emit(**row):
        gbps = row["bytes_read"] / row["time_us"] / 1e3 if row.get("time_us") else None
        row.update(gbps=gbps, pct_copy_bw=None if gbps is None or not copy_gbps else 100 * gbps / copy_gbps)
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        log.info("%s", row)

    def write_summary():  # rewritten after every case, so an interrupted run still leaves one
        summary = {
            "config": asdict(cfg), "device": props.name if props else str(device),
            "sm_count": props.multi_processor_count if props else None, "l2_bytes": l2,
            "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
            "commit": env.get("KVLOCKS_COMMIT"), "copy_gbps": copy_gbps, "rows": rows, "errors": errors,
            "score_kernel": _score_kernel_name(device),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    for bsz in cfg.batches:  # batch 1 first: the headline rows come early
        for shape in cfg.shapes:
            for n in cfg.contexts:
                n_rot, fits = _n_rot(shape, n, bsz, cfg, l2)
                key = dict(shape=shape, context=n, batch=bsz, budget=cfg.budget)
                if not fits:
                    errors.append({**key, "error": "skipped: does not fit mem_limit_gib"})
                    continue
                try:
                    case = _Case(shape, n, bsz, n_rot, cfg, device, gen)
                    nbytes = _bytes(case, case.lcfg.pages_per_step)
                    extras, methods = _methods(case, device)
                    if bsz == 1 and n == max(cfg.contexts):
                        methods.update(extras)
                    for name, fn in methods.items():
                        try:
                            t, eager = timer(fn, n_rot, cfg)
                            extra = {"tuned": _tuned_score_config()} if name == "locks_score" else {}
                            if name == "dense_splitk" and case.dense_launch:
                                extra = {"launch": case.dense_launch}
                            emit(**key, method=name, time_us=t, bytes_read=nbytes[name], time_us_eager=eager,
                                 rotations=n_rot, **extra)
                        except Exception as e:  # one failing method must not sink the run
                            errors.append({**key, "method": name, "error": repr(e)[:500]})
                            log.exception("%s failed", name)
                    if bsz == 1 and "build" in METHODS:
                        layers = SHAPES[shape][3]
                        t, per_layer, extrap = _time_build(case, layers, cfg, device)
                        emit(**key, method="build", time_us=t, layers=layers, per_layer_us=per_layer,
                             extrapolated=extrap, tuned=_tuned_build_config(),
                             bytes_read=layers * case.p * case.hkv * cfg.page_size * case.d * 2)
                except Exception as e:
                    errors.append({**key, "error": repr(e)[:500]})
                    log.exception("case %s failed", key)
                finally:
                    case = None
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    write_summary()
    jsonl.close()
    return write_summary()


def format_table(summary: dict) -> str:
    """One line per row: shape, context, batch, method, time, GB/s, % of copy bandwidth."""
    lines = [f"copy {summary['copy_gbps']} GB/s on {summary['device']}",
             f"{'shape':12} {'ctx':>8} {'B':>3} {'method':13} {'time_us':>10} {'GB/s':>7} {'%copy':>6}"]
    for r in summary["rows"]:
        g = r.get("gbps") or float("nan")
        pc = r.get("pct_copy_bw") or float("nan")
        lines.append(f"{r['shape']:12} {r['context']:>8} {r['batch']:>3} {r['method']:13} {r['time_us']:>10.1f} "
                     f"{g:>7.0f} {pc:>6.1f}")
    lines += [f"ERROR {e}" for e in summary["errors"]]
    return "\n".join(lines)

