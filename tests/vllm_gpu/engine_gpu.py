"""Run one CUDA vLLM engine in its own process and write its results as JSON (the GPU tests).

Usage: python engine_gpu.py SPEC.json OUT.json. SPEC: {"llm": {LLM kwargs}, "prompts": [token-id
lists], "max_tokens": int, "locks": LocksConfig JSON or null, "batches": [[prompt index, ...], ...]
(one generate call each; default all at once), "model": path (default: the bundled model),
"logprobs": int or null (the top log-probabilities of every output position), "strict": bool (the
plugin's strict setting), "memory_probe": bool (where the device memory grew: ``memory_probe.py``)}.
Greedy, ignoring EOS. The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
set by the caller), so the LOCKS backend's debug counters are read here after generating.
OUT: {"tokens", "logprobs" (per prompt and position: {token id: log-probability}, or null), "counters", "preemptions", "preempted_at", "init_s", "gen_s", "num_gpu_blocks", "memory"}; ``memory``: the device's total and used
bytes after generating and torch's allocator figures in this process (:func:`_memory`), with the same
taken after the engine started under ``after_init``; ``preempted_at``: per
prompt, the number of its output tokens at each of its preemptions (read from vLLM's scheduler,
whose ``_preempt_request`` is wrapped in this process; vLLM 0.26 and 0.32 name it so).
"""

import json
import sys
import time


def _memory() -> dict:
    """The device's total and used bytes and this process's torch allocator figures (current and peak
    allocated / reserved, and the reserved bytes no tensor uses: fragmentation and cached blocks)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    st = torch.cuda.memory_stats()
    return {"total": total, "used": total - free, "torch_peak_reserved": torch.cuda.max_memory_reserved(),
            "torch_peak_allocated": torch.cuda.max_memory_allocated(),
            "torch_reserved": st.get("reserved_bytes.all.current", 0),
            "torch_allocated": st.get("allocated_bytes.all.current", 0),
            "torch_inactive_split": st.get("inactive_split_bytes.all.current", 0)}


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    from kvlocks.config import LocksConfig
    from kvlocks.integrations.vllm import enable
    from kvlocks.models import resolve

    if spec.get("locks"):
        # these tests check LOCKS itself on short prompts: every step selects unless the spec says otherwise
        enable(LocksConfig.from_json(spec["locks"]), strict=bool(spec.get("strict")),
               dense_below=spec.get("dense_below", 0))
    from vllm.v1.core.sched.scheduler import Scheduler

    events = []  # (internal request id, output tokens so far) per preemption
    original = Scheduler._preempt_request

    def _preempt_request(self, request, *args, **kwargs):
        events.append((request.request_id, len(request.output_token_ids)))
        return original(self, request, *args, **kwargs)

    Scheduler._preempt_request = _preempt_request
    probe = None
    if spec.get("memory_probe"):
        from memory_probe import Probe

        probe = Probe()
        probe.wrap_runner()
    t0 = time.time()
    llm = LLM(model=spec.get("model") or str(resolve("smollm2-135m")), seed=0, **spec["llm"])
    t1 = time.time()
    after_init = _memory()
    if probe is not None:
        probe.check("engine start")
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    outs, ids, lps = [], {}, {}
    for group in spec.get("batches") or [list(range(len(prompts)))]:
        res = llm.generate([prompts[i] for i in group], params, use_tqdm=False)
        outs += [(i, list(r.outputs[0].token_ids)) for i, r in zip(group, res)]
        if spec.get("logprobs"):
            lps.update({i: [{str(t): lp.logprob for t, lp in pos.items()} for pos in r.outputs[0].logprobs]
                        for i, r in zip(group, res)})
        ids.update({r.request_id: i for i, r in zip(group, res)})
    preempted_at = [[] for _ in prompts]
    for rid, n in events:  # the engine's id is the request's, or it with a suffix after "-"
        preempted_at[next(i for ext, i in ids.items() if rid == ext or rid.startswith(ext + "-"))].append(n)
    gen_s = time.time() - t1
    counters = None
    if spec.get("locks"):
        from kvlocks.integrations.vllm.cuda.backend import debug_counters

        counters = debug_counters()
    preemptions = None
    try:
        preemptions = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    except Exception:  # noqa: BLE001 - stats disabled (the LLM default) or no prometheus_client
        pass
    memory = {**_memory(), "after_init": after_init}
    if probe is not None:
        memory["probe"] = probe.report()
    num_gpu_blocks = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    num_gpu_blocks = getattr(num_gpu_blocks, "num_gpu_blocks", None)
    json.dump({"num_gpu_blocks": num_gpu_blocks, "memory": memory, "tokens": [t for _, t in sorted(outs)],
               "logprobs": [lps[i] for i in sorted(lps)] or None,
               "counters": counters, "preemptions": preemptions,
               "preempted_at": preempted_at, "init_s": t1 - t0, "gen_s": gen_s}, open(sys.argv[2], "w"))
