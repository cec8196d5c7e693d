"""Run one vLLM engine in its own process and print its results as JSON (used by the tests).

Usage: python engine_run.py SPEC.json OUT.json. SPEC: {"llm": {LLM kwargs}, "prompts": [str or
token-id list], "max_tokens": int, "locks": LocksConfig JSON or null, "model": a model directory
(default: the bundled model)}. Greedy sampling. The
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
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = []
    for group in spec.get("batches") or [list(range(len(prompts)))]:
        res = llm.generate([prompts[i] for i in group], params, use_tqdm=False)
        outs += [(i, list(r.outputs[0].token_ids)) for i, r in zip(group, res)]
    tokens = [t for _, t in sorted(outs)]
    json.dump({"tokens": tokens, "init_s": t1 - t0, "gen_s": time.time() - t1}, open(sys.argv[2], "w"))
