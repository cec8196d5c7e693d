"""Run one CUDA vLLM engine with the kvlocks KV connector (and optionally the LOCKS backend) and write
its results as JSON. Usage: python connector_gpu.py SPEC.json OUT.json. SPEC: {"llm": {LLM kwargs},
"cache_dir": str, "max_tokens": int, "locks": LocksConfig JSON or null, "batches": [[{"id", "file",
"new": [ids]}, ...], ...], "logprobs": int or null (the top log-probabilities of every output position)}.
Greedy, stopping at EOS. In-process engine core (the caller sets VLLM_ENABLE_V1_MULTIPROCESSING=0)
so the LOCKS counters are read here. OUT: {"results": {id: {"tokens", "finish", "num_cached_tokens",
"logprobs" (with "logprobs": per position {token id: log-probability})}}, "counters"}."""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    from kvlocks.config import LocksConfig
    from kvlocks.integrations.vllm import enable
    from kvlocks.integrations.vllm.connector.compacted import compacted_request
    from kvlocks.models import resolve

    if spec.get("locks"):
        enable(LocksConfig.from_json(spec["locks"]), dense_below=0)  # every step past the budget selects
    kv = {"kv_connector": "KvlocksConnector", "kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector",
          "kv_role": "kv_consumer", "kv_connector_extra_config": {"cache_dir": spec["cache_dir"]}}
    llm = LLM(model=str(resolve("smollm2-135m")), seed=0, kv_transfer_config=kv, **spec["llm"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    results = {}
    for batch in spec["batches"]:
        prompts, params = [], []
        for r in batch:
            prompt, kv_params = compacted_request(r["file"], r["new"], vocab, name=Path(r["file"]).name)
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=spec.get("logprobs"),
                                         extra_args={"kv_transfer_params": kv_params}))
        for r, o in zip(batch, llm.generate(prompts, params, use_tqdm=False)):
            results[r["id"]] = {"tokens": list(o.outputs[0].token_ids), "finish": str(o.outputs[0].finish_reason),
                                "num_cached_tokens": o.num_cached_tokens}
            if spec.get("logprobs"):
                results[r["id"]]["logprobs"] = [{str(t): lp.logprob for t, lp in pos.items()}
                                                for pos in o.outputs[0].logprobs]
    counters = None
    if spec.get("locks"):
        from kvlocks.integrations.vllm.cuda.backend import debug_counters

        counters = debug_counters()
    json.dump({"results": results, "counters": counters}, open(sys.argv[2], "w"))
