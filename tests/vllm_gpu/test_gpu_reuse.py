"""Block reuse on the GPU: prefix caching on and a KV pool so small that requests are preempted and
their blocks reused. No LOCKS step reads a summary whose tags do not match its block, none reads a
summary built from other keys, and the outputs equal a run without reuse: exactly for requests that
were never preempted, and up to the first preemption for those that were.

vLLM preempts by recomputation: a resumed request prefills its prompt and the tokens it generated
so far, densely, where the first run computed those tokens' keys and values under LOCKS's sparse
decode. The two differ (as for any approximate decode attention), so a preempted request may
continue differently from there. How often that happened is measured against the run resumed by
hand (prompt + the tokens before the last preemption, prefilled), not asserted: blocks of generated
tokens that stayed in the prefix cache keep their sparse-decode keys, which that run does not
reproduce."""

from __future__ import annotations

from gpu_helpers import long_text, run_engine, save, tokenize

from kvlocks.config import LocksConfig

NEW = 64
INVARIANT = {"VLLM_BATCH_INVARIANT": "1"}  # FlashAttention and GEMMs batch-invariant: outputs do not
# depend on which requests share a step (preemption changes that); kvlocks' kernels at budget 64
# attend their 4 pages in one split


def test_prefix_caching_and_preemption_never_use_a_stale_summary(tmp_path):
    # five prompts of 619-621 tokens (39 blocks of 16) with no block in common, then the first again
    # (a prefix-cache hit on blocks that other requests may have reused meanwhile)
    prompts = [tokenize(long_text(36, seed=i)) for i in range(5)]
    prompts.append(prompts[0])
    assert max(len(p) for p in prompts) + NEW < 1280
    cfg = LocksConfig(budget=64).to_json()
    # 84 blocks: two requests start (78 blocks) and each needs 5 more for 64 new tokens (88 > 84), so
    # vLLM preempts one, frees its blocks and hands them to the other requests
    small = {"max_model_len": 1280, "num_gpu_blocks_override": 84, "max_num_seqs": 4,
             "enable_prefix_caching": True, "disable_log_stats": False}
    spec = {"prompts": prompts, "max_tokens": NEW, "locks": cfg}
    debug = {**INVARIANT, "KVLOCKS_VLLM_CHECK": "1", "KVLOCKS_VLLM_VERIFY": "1"}
    reuse = run_engine({**spec, "llm": small}, tmp_path, "reuse", env=debug)
    # the plain run also takes each preempted prompt resumed by hand after its last preemption
    last = [(i, at[-1]) for i, at in enumerate(reuse["preempted_at"]) if at]
    resumed = [prompts[i] + reuse["tokens"][i][:n] for i, n in last]
    plain = run_engine({**spec, "prompts": prompts + resumed,
                        "llm": {"max_model_len": 1280, "max_num_seqs": 4, "enable_prefix_caching": False}},
                       tmp_path, "plain", env=INVARIANT)
    notags = run_engine({**spec, "llm": small}, tmp_path, "notags", env={**debug, "KVLOCKS_VLLM_IGNORE_TAGS": "1"})
    after = {i: reuse["tokens"][i][n:] == plain["tokens"][len(prompts) + j][:NEW - n] for j, (i, n) in enumerate(last)}
    save(tmp_path, "reuse.json", {"reuse": reuse, "plain": plain, "notags": notags,
                                  "equal_after_last_preemption_as_resumed_by_hand": after})
    c = reuse["counters"]
    assert reuse["preemptions"] and last, f"no request was preempted ({reuse['preemptions']}): the pool is not small enough"
    assert c["locks_rows"] > 0 and c["pages_checked"] > 0, c
    assert c["tag_mismatches"] == 0 and c["stale_used"] == 0, c
    # exact where no recomputation happened: the whole output of a request never preempted, the
    # tokens before the first preemption of one that was
    compared = 0
    for i, at in enumerate(reuse["preempted_at"]):
        n = at[0] if at else NEW
        assert reuse["tokens"][i][:n] == plain["tokens"][i][:n], (i, at)
        compared += n
    assert compared >= 3 * NEW, reuse["preempted_at"]  # not vacuous: at least three requests' worth
    assert notags["counters"]["stale_used"] > 0, f"the negative control used no stale summary: {notags['counters']}"
