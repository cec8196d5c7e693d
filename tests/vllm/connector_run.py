"""Run one vLLM engine with the kvlocks KV connector and print its results as JSON (connector tests).

Usage: python connector_run.py SPEC.json OUT.json. SPEC: {"llm": {LLM kwargs}, "cache_dir": str,
"max_tokens": int, "batches": [[request, ...], ...]}; a request is {"id", "file": path, "new": [ids]}
(prompt and kv_transfer_params from ``compacted_request``, the file named relative to cache_dir),
optionally with "name" (what to send instead), "prompt" (token ids to send instead) or "raw"
(build the prompt without the client helper's checks, as a hand-made request would; from the
placeholders of "placeholders_from" when the file's own header cannot be read). Each
batch is one ``generate`` call, in order. Greedy, stopping at EOS. OUT: per request id its tokens
and finish reason.
"""

import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    from kvlocks.integrations.vllm.connector.compacted import PARAM, compacted_request, placeholder_ids, read_header
    from kvlocks.models import resolve

    t0 = time.time()
    kv = {"kv_connector": "KvlocksConnector", "kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector",
          "kv_role": "kv_consumer", "kv_connector_extra_config": {"cache_dir": spec["cache_dir"]}}
    llm = LLM(model=str(resolve("smollm2-135m")), enforce_eager=True, seed=0, kv_transfer_config=kv, **spec["llm"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    t1 = time.time()
    results = {}
    for batch in spec["batches"]:
        prompts, params = [], []
        for r in batch:
            name = r.get("name", Path(r["file"]).name)
            if r.get("raw"):  # as a hand-made (or remote) request would send it: no client-side checks
                try:
                    header = read_header(r["file"])
                except ValueError:  # a file without a readable header: the placeholders of another
                    header = read_header(r["placeholders_from"])
                ids = placeholder_ids(header, vocab) + r["new"]
                prompt, kv_params = {"prompt_token_ids": ids}, {PARAM: name}
            else:
                prompt, kv_params = compacted_request(r["file"], r["new"], vocab, name=name)
            if "prompt" in r:
                prompt = {"prompt_token_ids": r["prompt"]}
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0,
                                         extra_args={"kv_transfer_params": kv_params}))
        outs = llm.generate(prompts, params, use_tqdm=False)
        for r, o in zip(batch, outs):
            results[r["id"]] = {"tokens": list(o.outputs[0].token_ids), "finish": str(o.outputs[0].finish_reason),
                                "num_cached_tokens": o.num_cached_tokens, "request_id": o.request_id}
    json.dump({"results": results, "init_s": t1 - t0, "gen_s": time.time() - t1}, open(sys.argv[2], "w"))
