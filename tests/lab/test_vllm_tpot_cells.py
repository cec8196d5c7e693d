"""The vLLM TPOT benchmark's cell plan (which context runs with which batch sizes), no vLLM needed."""

from __future__ import annotations

import json

import pytest

from kvlocks_lab.bench.vllm_tpot import CONFIGS, parse_context, plan_cells

H200 = 150_000_000_000  # bytes of GPU memory, about the H200's 139.8 GiB


def _cfg(name):
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_contexts_name_their_own_batches_and_are_cut_to_the_positions():
    glm = plan_cells(_cfg("glm4-9b-1m"), ["32768", "131072", "262144:1"], [1, 4], H200, 64, 524288)
    assert glm == {32768: {1, 4}, 131072: {1, 4}, 262144: {1}}
    llama = plan_cells(_cfg("llama3.1-8b"), ["131072:1,2"], [1, 4], H200, 64, 524288)
    assert llama == {(131072 - 64 - 16) // 1024 * 1024: {1, 2}}  # 130,048: the new tokens fit 131,072 positions


@pytest.mark.parametrize("text,needle", [("12k", "a token count"), ("4096:x", "integers"), ("4096:0", ">= 1")])
def test_a_bad_context_is_refused_with_its_reason(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_context(text, [1])
