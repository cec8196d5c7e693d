"""Kernel classes and per-step kernel times of the profile benchmarks (hand-computed cases)."""

from __future__ import annotations

from kvlocks_lab.bench.kernel_classes import classify, per_step, summarize


def test_names_fall_in_their_classes():
    assert classify("void flash::FlashAttnFwdSm90<...>") == "flash_attn"
    assert classify("void flash::flash_fwd_splitkv_combine_kernel<...>") == "flash_attn"
    assert classify("kvlocks::score_kernel<128, 8>") == "locks_score"
    assert classify("_rank_select_kernel") == "locks_select"
    assert classify("_attn_kernel") == "attend" and classify("_merge_kernel") == "attend"
    assert classify("_build_kernel") == "locks_build"
    assert classify("nvjet_tst_128x64_64x4") == "weights_gemm"
    assert classify("triton_red_fused_rms_norm_0") == "other"
    assert classify("void vllm::reshape_and_cache_flash_kernel<...>") == "kv_write"
    assert classify("triton_poi_fused_add_cat_index_select_mul_3") == "other"  # Inductor's, not the selection
    assert classify("_exact_kernel") == classify("_pick_kernel") == "locks_rerank"
    assert classify("_note_writes_kernel") == "locks_build"


def test_per_step_is_the_difference_of_two_runs_over_the_extra_steps():
    short = {"gemv": [100.0, 10], "prefill_only": [50.0, 1]}
    long = {"gemv": [400.0, 40], "prefill_only": [50.0, 1], "_merge_kernel": [30.0, 6]}
    got = per_step(long, short, 3)
    assert got == {"gemv": [100.0, 10.0], "_merge_kernel": [10.0, 2.0]}  # the kernel of both runs alone cancels
    s = summarize(got)
    assert s["kernel_sum_us"] == 110.0 and s["launches"] == 12.0
    assert s["classes_us"] == {"attend": 10.0, "weights_gemm": 100.0}
    assert [k["name"] for k in s["top_kernels"]] == ["gemv", "_merge_kernel"]
