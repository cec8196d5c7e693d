"""Run one vLLM engine in its own process and print its results as JSON (used by the tests).

Usage: python engine_run.py SPEC.json OUT.json. SPEC: {"llm": {LLM kwargs}, "prompts": [str or
token-id list], "max_tokens": int, "locks": LocksConfig JSON or null, "model": a model directory
(default: the bundled model), "logprobs": int or null (the top log-probabilities of every output
position)}. Greedy sampling. OUT: {"tokens", "logprobs" (per prompt and position: {token id:
log-probability}, or null), "init_s", "gen_s"}. The
LocksConfig goes through kvlocks.integrations.vllm.enable (the Python route); environment
variables (KVLOCKS_VLLM_TRACE, ...) are inherited from the caller.
"""

import json
import sys
import time

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    from kvlocks.config import LocksConfig
    from kvlocks.integrations.vllm import enable
    from kvlocks.models import resolve

    if spec.get("locks"):
        enable(LocksConfig.from_json(spec["locks"]))
    t0 = time.time()
    llm = LLM(model=spec.get("model") or str(resolve("smollm2-135m")), enforce_eager=True, seed=0, **spec["llm"])
    t1 = time.time()
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in spec["prompts"]]
    top = spec.get("logprobs")
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=top)
    outs = []
    for group in spec.get("batches") or [list(range(len(prompts)))]:
        res = llm.generate([prompts[i] for i in group], params, use_tqdm=False)
        outs += [(i, list(r.outputs[0].token_ids),
                  [{str(t): lp.logprob for t, lp in pos.items()} for pos in r.outputs[0].logprobs] if top else None)
                 for i, r in zip(group, res)]
    outs.sort(key=lambda o: o[0])
    json.dump({"tokens": [o[1] for o in outs], "logprobs": [o[2] for o in outs] if top else None,
               "init_s": t1 - t0, "gen_s": time.time() - t1}, open(sys.argv[2], "w"))
