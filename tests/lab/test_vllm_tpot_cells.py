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


def test_hybrid_shapes_count_their_global_layers_per_token_and_their_windows_per_request():
    from kvlocks_lab.bench.vllm_tpot import kv_bytes_per_request, kv_bytes_per_token, weight_bytes

    gemma, oss = _cfg("gemma3-12b"), _cfg("gpt-oss-20b")
    # Gemma-3-12B: 48 layers, every sixth global (8), 8 KV heads of 256, windows of 1,024 tokens
    assert kv_bytes_per_token(gemma) == 8 * 8 * 256 * 2 * 2
    assert kv_bytes_per_request(gemma) == 40 * (1024 + 16) * 8 * 256 * 2 * 2
    # gpt-oss-20b: 24 layers alternating (12 global), 8 KV heads of 64, windows of 128 tokens
    assert kv_bytes_per_token(oss) == 12 * 8 * 64 * 2 * 2
    assert kv_bytes_per_request(oss) == 12 * (128 + 16) * 8 * 64 * 2 * 2
    # a dense model has no window layers
    assert kv_bytes_per_request(_cfg("llama3.1-8b")) == 0
    assert kv_bytes_per_token(_cfg("llama3.1-8b")) == 32 * 8 * 128 * 2 * 2
    # gpt-oss-20b in bf16: 32 experts of gated MLPs (2880 x 2880 x 3) in each of 24 layers, about 21B parameters
    attn = 2880 * (64 * 64 + 2 * 8 * 64) + 64 * 64 * 2880
    assert weight_bytes(oss) == 2 * (24 * (attn + 32 * 3 * 2880 * 2880) + 2 * 201088 * 2880)
    assert 20.5e9 < weight_bytes(oss) / 2 < 21.5e9
    # Gemma-3-12B ties its embeddings: counted once; about 12B parameters
    assert 11.5e9 < weight_bytes(gemma) / 2 < 12.5e9


def test_hybrid_shapes_fit_128k_at_batch_4_on_an_h100():
    h100 = 85_000_000_000
    for name in ("gemma3-12b", "gpt-oss-20b"):
        cells = plan_cells(_cfg(name), ["131072"], [1, 4], h100, 64, 131072)
        assert cells == {(131072 - 64 - 16) // 1024 * 1024: {1, 4}}, (name, cells)


def test_the_random_prefix_connector_is_refused_for_hybrid_shapes(tmp_path, capsys):
    from kvlocks_lab.bench.vllm_tpot import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--models", "gpt-oss-20b", "--prefix", "connector", "--contexts", "131072"])
    err = capsys.readouterr().err
    assert "sliding-window layers" in err and "--prefix prefill" in err and "gpt-oss-20b" in err


@pytest.mark.parametrize("locks,needle", [('{"budget": 512}', "other than budget"), ('[1]', "other than budget"),
                                          ('{"rerank": -1}', "rerank"), ('{"bogus": 1}', "bogus")])
def test_bad_locks_settings_are_refused_before_any_engine(tmp_path, capsys, locks, needle):
    from kvlocks_lab.bench.vllm_tpot import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--models", "llama3.1-8b", "--contexts", "32768", "--locks", locks])
    err = capsys.readouterr().err
    assert "--locks" in err and needle in err
