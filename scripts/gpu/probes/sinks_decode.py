"""Learned sinks at decode on the GPU: kvlocks' sink-corrected attention and vLLM's FlashAttention 3
(``s_aux``), each against a float64 softmax with the sink, on the gpt-oss-like test's shapes.

The shape of ``tests/vllm_gpu/test_gpu_layers.py::test_gpt_oss_like_sinks_enter_the_softmax``'s global
layers: Hq = 8, Hkv = 2, D = 64, page 16, bfloat16, sinks 3-7 nats, a block table 256 pages wide
(``max_model_len`` 4096), budget 4096 (every page fits: exact attention), a batch of two rows that
decode ``--steps`` tokens from ``--base`` (default 1500 and 2300 tokens, the test's prompts 1 and 2:
steps 0-24 reach 1524 and 2324). The cache is vLLM's FlashAttention layout
(``[blocks, Hkv, 16, 2 D]`` stored NHD), the queries a strided view of a fused qkv row, as vLLM
passes them. For every step, the float64 reference gives the attention without the sink (``out0``),
its natural-log log-sum-exp and the attention with the sink; then

- ``plan``: :class:`~kvlocks.plan.DecodePlan` (Triton) alone: errors of ``out0`` and of ``lse``;
- ``eager``, ``graph``: the CUDA backend's decoder (:class:`~kvlocks.integrations.vllm.cuda.step.LocksDecoder`
  with the sinks): an eager uniform step, and the captured path replayed from one CUDA graph captured
  as vLLM captures its decode graphs (every row at 1 token), the lengths copied in before each replay;
- ``fa3_eager_splitsN``, ``fa3_graph_splitsN`` (with vLLM importable): ``flash_attn_varlen_func`` as
  vLLM 0.26's ``FlashAttentionImpl`` calls it for this hybrid model (no AOT scheduler: two window
  sizes; ``num_splits`` 32 in full graphs, captured at ``max_seqlen_k = max_model_len``), eagerly
  and replayed.

A row whose error passes ``--tol`` is a failure; ``OUT/sinks_decode.jsonl`` holds one record per
(path, step, row): max abs errors ``err`` (with the sink), ``err_out0`` and ``err_lse`` (plan only);
``OUT/sinks_decode.json`` the first failing step of each path, device and versions.

    python3 scripts/gpu/probes/sinks_decode.py --out $OUT
    python3 scripts/gpu/probes/sinks_decode.py --out $OUT --blocks 262144   # the test's pool size
    TRITON_INTERPRET=1 python3 scripts/gpu/probes/sinks_decode.py --out /tmp/sinks --steps 15,16   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

from kvlocks.config import LocksConfig  # noqa: E402
from kvlocks.integrations.vllm.cuda.compat import split_flash_kv_cache  # noqa: E402
from kvlocks.integrations.vllm.cuda.step import LocksDecoder, LocksStep, PlanPool, step_lens  # noqa: E402
from kvlocks.plan import DecodePlan  # noqa: E402

S, HKV, G, D, WIDTH = 16, 2, 4, 64, 256
HQ, SCALE = HKV * G, 64 ** -0.5
CFG = LocksConfig(budget=4096)


def make_case(base, blocks, seed):
    """Cache (vLLM's layout), block table, sinks and a generator for the queries."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(blocks, S, HKV, 2 * D, generator=gen).to(torch.bfloat16)  # NHD memory
    kv = raw.to(DEV).permute(0, 2, 1, 3)  # [blocks, Hkv, S, 2D], as vLLM shapes it
    need = -(-(max(base) + 64) // S)
    ids = torch.randperm(blocks - 1, generator=gen)[: len(base) * need] + 1  # block 0: vLLM's null block
    table = torch.zeros(len(base), WIDTH, dtype=torch.int32)
    table[:, :need] = ids.view(len(base), need).to(torch.int32)
    sinks = (torch.rand(HQ, generator=gen) * 4 + 3).to(torch.bfloat16)
    return raw, kv, table.to(DEV), sinks.to(DEV), gen


def reference(raw, table, lens, q, sinks):
    """float64 per row and query head: (out0 [B, Hq, D], lse [B, Hq], out with the sink)."""
    b_n = len(lens)
    out0 = torch.zeros(b_n, HQ, D, dtype=torch.float64)
    lse = torch.zeros(b_n, HQ, dtype=torch.float64)
    outs = torch.zeros_like(out0)
    table, q, sinks = table.cpu(), q.cpu().double(), sinks.cpu().double()
    for b, n in enumerate(lens):
        t = torch.arange(n)
        phys = table[b, t // S].long()
        for h in range(HKV):
            k = raw[phys, t % S, h, :D].double()
            v = raw[phys, t % S, h, D:].double()
            logits = q[b, h * G:(h + 1) * G] @ k.T * SCALE  # [G, n]
            lse[b, h * G:(h + 1) * G] = torch.logsumexp(logits, -1)
            out0[b, h * G:(h + 1) * G] = torch.softmax(logits, -1) @ v
            full = torch.cat([logits, sinks[h * G:(h + 1) * G, None]], -1)
            outs[b, h * G:(h + 1) * G] = torch.softmax(full, -1)[:, :-1] @ v
    return out0, lse, outs


def row_errors(got, want):
    return (got.double().cpu() - want).abs().flatten(1).max(1).values.tolist()


class Paths:
    """The kernels under test, each with its persistent inputs (what a CUDA graph reads)."""

    def __init__(self, kv, table, sinks, batch):
        self.keys, self.values = split_flash_kv_cache(kv, HKV, D)
        self.table, self.sinks, self.b = table, sinks, batch
        self.lens = torch.ones(batch, dtype=torch.int32, device=DEV)
        self.qkv = torch.zeros(batch, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=DEV)
        self.q = self.qkv[:, : HQ * D].view(batch, HQ, D)  # strided, as vLLM's q view of qkv
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        self.dec = LocksDecoder(CFG, num_kv_heads=HKV, group=G, head_dim=D, scale=SCALE, pool=PlanPool(),
                                sinks=sinks, backend="triton")
        self.store = self.dec.bind(self.keys)
        self.dec.pool.prepare(self.dec.shape(WIDTH, torch.bfloat16, DEV), batch)
        self.plan = DecodePlan(batch=batch, num_kv_heads=HKV, group=G, head_dim=D, max_pages=WIDTH, config=CFG,
                               dtype=torch.bfloat16, device=DEV, scale=SCALE, backend="triton")
        self.out = torch.zeros(batch, HQ, D, dtype=torch.bfloat16, device=DEV)
        self.graphs = {}

    def step(self):
        sparse, _, locks = step_lens(self.qsl, self.lens, S, CFG.pages_per_step)
        return LocksStep(num_reqs=self.b, uniform_decode=True, query_start_loc=self.qsl, seq_lens=self.lens,
                         block_table=self.table, sparse=sparse, locks_lens=locks)

    def note_all_written(self, lens):
        for b, n in enumerate(lens):
            t = torch.arange(n, device=DEV)
            self.store.note_writes(self.table[b, t // S].long() * S + t % S)

    def kvlocks_eager(self):
        self.dec.run(self.step(), self.q, self.keys, self.values, self.out, captured=False)
        return self.out

    def kvlocks_captured(self):
        self.dec.run(self.step(), self.q, self.keys, self.values, self.out, captured=True)

    def fa3(self, splits, max_k):
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        flash_attn_varlen_func(q=self.q, k=self.keys, v=self.values, out=self.out, cu_seqlens_q=self.qsl,
                               max_seqlen_q=1, seqused_k=self.lens, max_seqlen_k=max_k, softmax_scale=SCALE,
                               causal=True, window_size=[-1, -1], block_table=self.table, softcap=0.0,
                               scheduler_metadata=None, fa_version=3, num_splits=splits, s_aux=self.sinks)
        return self.out

    def replay(self, name, fn):
        """``fn`` from a CUDA graph captured with every row at 1 token (as vLLM captures decode)."""
        if name not in self.graphs:
            keep = self.lens.clone()
            self.lens.fill_(1)
            fn()  # warm-up (and compiles) outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            self.graphs[name] = g
            self.lens.copy_(keep)
        self.graphs[name].replay()
        torch.cuda.synchronize()
        return self.out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="1500,2300", help="row lengths at step 0")
    ap.add_argument("--steps", default=",".join(map(str, range(25))))
    ap.add_argument("--blocks", type=int, default=4096, help="blocks in the cache (the test's pool: 262144)")
    ap.add_argument("--tol", type=float, default=2e-2, help="max abs error of a bf16 output row (and of lse)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    base = [int(x) for x in args.base.split(",")]
    steps = [int(x) for x in args.steps.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw, kv, table, sinks, gen = make_case(base, args.blocks, args.seed)
    paths = Paths(kv, table, sinks, len(base))
    paths.note_all_written([n + max(steps) for n in base])  # vLLM's cache writes (the tags' generations)
    try:
        import vllm  # noqa: F401

        fa3 = DEV == "cuda"
    except ImportError:
        fa3 = False
    runs = {"eager": paths.kvlocks_eager}
    if DEV == "cuda":
        runs["graph"] = lambda: paths.replay("graph", paths.kvlocks_captured)
    if fa3:
        for splits in (0, 32):
            runs[f"fa3_eager_splits{splits}"] = lambda s=splits: paths.fa3(s, int(paths.lens.max()))
        runs["fa3_graph_splits32"] = lambda: paths.replay("fa3", lambda: paths.fa3(32, WIDTH * S))
    first_bad, worst, failed = {}, {}, {}
    with open(out_dir / "sinks_decode.jsonl", "w") as f:
        for j in steps:
            lens = [n + j for n in base]
            paths.lens.copy_(torch.tensor(lens, dtype=torch.int32))
            paths.qkv.copy_(torch.randn(paths.qkv.shape, generator=gen).to(torch.bfloat16))
            out0, lse, outs = reference(raw, table, lens, paths.q, sinks)
            o, l = paths.plan.run(paths.q, paths.keys, paths.values, paths.store.summaries, table, paths.lens)
            recs = [{"path": "plan", "step": j, "row": b, "len": n, "err_out0": e0, "err_lse": el}
                    for b, (n, e0, el) in enumerate(zip(lens, row_errors(o, out0),
                                                        row_errors(l[..., None], lse[..., None])))]
            for name, fn in list(runs.items()):
                try:
                    got = fn().clone()
                except Exception as exc:  # noqa: BLE001 - e.g. FA3 refusing an input: record it, run the rest
                    failed[name] = f"{type(exc).__name__}: {exc}"[:300]
                    del runs[name]
                    continue
                recs += [{"path": name, "step": j, "row": b, "len": n, "err": e}
                         for b, (n, e) in enumerate(zip(lens, row_errors(got, outs)))]
            line = []
            for r in recs:
                f.write(json.dumps(r) + "\n")
                e = max(r.get("err", 0.0), r.get("err_out0", 0.0), r.get("err_lse", 0.0))
                worst[r["path"]] = max(worst.get(r["path"], 0.0), e)
                if e > args.tol and r["path"] not in first_bad:
                    first_bad[r["path"]] = {"step": j, "row": r["row"], "len": r["len"], "err": e}
                line.append(f"{r['path']}[{r['row']}] {e:.1e}")
            print(f"step {j} lens {lens}: " + ", ".join(line), flush=True)
    summary = {"first_bad": first_bad, "worst": worst, "failed": failed, "ok": not first_bad and not failed,
               "base": base, "steps": steps,
               "blocks": args.blocks, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
               "torch": torch.__version__, "fa3": fa3}
    (out_dir / "sinks_decode.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
