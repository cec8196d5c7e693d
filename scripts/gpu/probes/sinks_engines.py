"""Which engine leaves the others on the gpt-oss-like model: stock FLASH_ATTN and the LOCKS backend at
budget 4096, each in CUDA graphs and eagerly (``enforce_eager``), on the prompts, batches and greedy
tokens of ``tests/vllm_gpu/test_gpu_layers.py::test_gpt_oss_like_sinks_enter_the_softmax``, with the
model's top-2 routing (the test itself now routes every expert, after this probe's answer: a routing
flip; H100, docs/results/2026-12-06-h100-vllm-serving/).

Eager runs take FlashAttention's split count from its own heuristic at each step's real lengths; in full
CUDA graphs it is fixed at capture (``max_seqlen_k = max_model_len``, up to 32 splits); the LOCKS
backend attends the global layers with kvlocks' kernels in both. So: if ``stock`` alone leaves the other
three, FlashAttention's sinks in full graphs are at fault; if ``locks`` and ``locks_eager`` leave both
stock runs, kvlocks is, unless the ``*_all`` engines agree. The tiny model's MoE routes each token to 2
of 4 experts by bfloat16 router logits whose 2nd and 3rd largest lie close (transformers on the CPU,
bfloat16, this model and these prompts: gaps down to 5e-4 within 24 tokens): a last-bit difference
between two correct attentions can change one token's experts and with them the whole (near-uniform)
next-token distribution, which the test's margin check reads as a real difference. The ``*_all`` engines
run the same weights with every expert (``num_experts_per_tok`` 4: routing continuous); if ``stock_all``
and ``locks_all`` agree where ``stock`` and ``locks`` do not, the difference is a routing flip, not
attention. ``--cpu-router EPS`` runs only that CPU check: greedy decode, then the same tokens with the
global layers' attention outputs scaled by ``1 + EPS * N(0, 1)``, reporting each step's router gaps,
flipped routings and shared top-5 tokens. For every pair of engines, per prompt: the first position
where the greedy tokens differ and the first where the top-5 log-probabilities differ by more than
``--lp-tol``.
``OUT/sinks_engines.json`` (the pairs, every engine's tokens, log-probabilities and counters) and each
engine's log. Needs the ``tests model vllm`` bundles staged (``scripts/gpu/stage.py``).

    python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh
    python3 scripts/gpu/probes/sinks_engines.py --out $OUT
    python3 scripts/gpu/probes/sinks_engines.py --out /tmp/router --cpu-router 4e-3   # the CPU run, no vLLM
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "vllm_gpu")]

from gpu_helpers import run_engine  # noqa: E402
from tiny_models import VOCAB, gpt_oss_like  # noqa: E402

from kvlocks.config import LocksConfig  # noqa: E402


def prompts(lengths=(700, 1500, 2300), seed=4) -> list[list[int]]:
    """The test's prompts (``test_gpu_layers._prompts`` with its seed, the model's layer count)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(n)] for n in lengths]


def divergence(a: dict, b: dict, lp_tol: float) -> list[dict]:
    """Per prompt: first differing token and first position whose shared top log-probabilities differ."""
    rows = []
    for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        tok = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        lp, worst = None, 0.0
        for j, (la, lb) in enumerate(zip(a["logprobs"][i], b["logprobs"][i])):
            shared = la.keys() & lb.keys()
            d = max((abs(la[t] - lb[t]) for t in shared), default=float("inf"))
            worst = max(worst, d) if d != float("inf") else worst
            if lp is None and (d > lp_tol or len(shared) < 3):
                lp = j
        rows.append({"prompt": i, "first_token_diff": tok, "first_logprob_diff": lp, "max_shared_diff": worst})
    return rows


def router_flips_cpu(model: Path, eps: float, prompt_ids=(1, 2), steps: int = 24) -> list[dict]:
    """transformers on the CPU, bfloat16: greedy decode of the prompts, then the same tokens again with the
    global (odd) layers' attention outputs scaled by ``1 + eps * N(0, 1)``; per prompt and step, each
    layer's gap between its 2nd and 3rd router logits, the layers whose top-2 experts changed, the top-5
    tokens the two runs share and their largest log-probability difference."""
    import torch
    from transformers import GptOssForCausalLM

    lm = GptOssForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="eager").eval()
    gen, state, seen = torch.Generator().manual_seed(0), {"on": False}, {}

    def perturb(mod, args, out):
        if state["on"]:
            return (out[0] * (1 + eps * torch.randn(out[0].shape, generator=gen).to(out[0].dtype)),) + out[1:]

    def router(i):
        def hook(mod, args, out):
            top = torch.topk(out[0][-1].float(), 3)
            seen.setdefault(i, []).append((sorted(top.indices[:2].tolist()), float(top.values[1] - top.values[2])))
        return hook

    for i, layer in enumerate(lm.model.layers):
        layer.mlp.router.register_forward_hook(router(i))
        if i % 2:
            layer.self_attn.register_forward_hook(perturb)

    def decode(ids, on, forced=None):
        seen.clear()
        state["on"] = on
        out = lm(torch.tensor([ids]), use_cache=True)
        toks, tops = [], []
        for j in range(steps):
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            top = torch.topk(lp, 5)
            tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            toks.append(int(lp.argmax()) if forced is None else forced[j])
            out = lm(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        return toks, tops, {i: v[-steps - 1:-1] for i, v in seen.items()}  # the routings of each step's token

    rows = []
    with torch.no_grad():
        for k in prompt_ids:
            toks, a, ra = decode(prompts()[k], False)
            _, b, rb = decode(prompts()[k], True, toks)
            for j in range(steps):
                shared = a[j].keys() & b[j].keys()
                rows.append({"prompt": k, "step": j, "shared_top5": len(shared),
                             "max_lp_diff": max((abs(a[j][t] - b[j][t]) for t in shared), default=None),
                             "router_gaps": [ra[i][j][1] for i in sorted(ra)],
                             "flipped_layers": [i for i in sorted(ra) if ra[i][j][0] != rb[i][j][0]]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--lp-tol", type=float, default=1e-2)
    ap.add_argument("--engines", default="stock,locks,stock_eager,locks_eager,stock_all,locks_all")
    ap.add_argument("--cpu-router", type=float, default=None, metavar="EPS",
                    help="only the transformers CPU run (router_flips_cpu) at this perturbation, e.g. 4e-3")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = gpt_oss_like(out / "gpt_oss_like", experts_per_token=2)  # top-2 routing, as gpt-oss
    if args.cpu_router is not None:
        rows = router_flips_cpu(model, args.cpu_router)
        (out / "router_cpu.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            if r["flipped_layers"] or r["shared_top5"] < 5:
                print(r)
        return
    every = out / "gpt_oss_like_all_experts"  # the same weights, every expert for every token
    shutil.copytree(model, every, dirs_exist_ok=True)
    config = json.loads((every / "config.json").read_text())
    (every / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": config["num_local_experts"]}))
    spec = {"model": str(model), "llm": {"max_model_len": 4096, "skip_tokenizer_init": True}, "prompts": prompts(),
            "max_tokens": 24, "batches": [[0], [1, 2]], "logprobs": 5}
    locks = {"locks": LocksConfig(budget=4096).to_json(), "strict": True}
    specs = {"stock": spec, "stock_eager": {**spec, "llm": {**spec["llm"], "enforce_eager": True}},
             "locks": {**spec, **locks},
             "locks_eager": {**spec, **locks, "llm": {**spec["llm"], "enforce_eager": True}},
             "stock_all": {**spec, "model": str(every)}, "locks_all": {**spec, **locks, "model": str(every)}}
    res = {}
    for name in args.engines.split(","):
        res[name] = run_engine(specs[name], out, name, env={"KVLOCKS_VLLM_CHECK": "1"} if "locks" in name else None)
        print(name, "done", flush=True)
    pairs = {f"{a}~{b}": divergence(res[a], res[b], args.lp_tol) for a, b in itertools.combinations(res, 2)}
    for k, rows in pairs.items():
        print(k, [(r["prompt"], r["first_token_diff"], r["first_logprob_diff"]) for r in rows])
    (out / "sinks_engines.json").write_text(json.dumps({"pairs": pairs, "engines": res}, indent=1))


if __name__ == "__main__":
    main()
