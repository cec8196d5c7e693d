"""The ``kvlocks`` command as a user runs it (bundled model, CPU)."""

import json

import pytest

from kvlocks.cli import main

pytestmark = pytest.mark.model


@pytest.mark.parametrize("method", ["locks", "loki"])
def test_generate_json(method, capsys):
    rc = main(["generate", "--method", method, "--budget", "32", "--max-new-tokens", "3",
               "--prompt", "Name a colour.", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == method and out["config"]["budget"] == 32
    assert out["stats"]["decode_steps"] >= 1 and out["stats"]["pages_selected"] <= 2


def test_bad_arguments_give_clear_errors(capsys):
    assert main(["generate", "--budget", "40", "--prompt", "x"]) == 2
    assert "budget=40" in capsys.readouterr().err
    assert main(["generate", "--prompt", "   "]) == 2
    assert "empty" in capsys.readouterr().err


def _bench_args(argv):
    import argparse

    from kvlocks.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return bench, parser.parse_args(["bench", *argv])


def test_bench_options_build_configs():
    bench, args = _bench_args(["e2e", "--out", "x", "--contexts", "16K,1M", "--no-compile"])
    cfg = bench._e2e_config(args)
    assert cfg.contexts == (16384, 1 << 20) and cfg.compile is False
    bench, args = _bench_args(["e2e", "--out", "x"])
    assert bench._e2e_config(args).compile is True  # compiled step for dense and LOCKS by default
    assert bench._e2e_config(args).ttft_repeats == 3
    bench, args = _bench_args(["e2e", "--out", "x", "--ttft-repeats", "5"])
    assert bench._e2e_config(args).ttft_repeats == 5
    bench, args = _bench_args(["e2e", "--out", "x", "--ttft-repeats", "0"])
    with pytest.raises(ValueError, match="ttft_repeats"):
        bench._e2e_config(args)
    bench, args = _bench_args(["kernels", "--out", "x", "--shapes", "glm4-9b-1m", "--contexts", "256K", "--batches", "1,4"])
    kcfg = bench._kernels_config(args)
    assert kcfg.shapes == ("glm4-9b-1m",) and kcfg.contexts == (262144,) and kcfg.batches == (1, 4)
    bench, args = _bench_args(["kernels", "--out", "x", "--shapes", "gpt2"])
    with pytest.raises(ValueError, match="gpt2"):
        bench._kernels_config(args)


def test_bench_names_a_bad_option_before_it_needs_a_gpu(capsys):
    """The options are checked first, so a CPU machine (or a GPU one) reports the bad one by name."""
    assert main(["bench", "e2e", "--out", "x", "--batches", "2,0"]) == 2
    assert "E2EBenchConfig.batches=0" in capsys.readouterr().err
    assert main(["bench", "kernels", "--out", "x", "--shapes", "gpt2"]) == 2
    assert "gpt2" in capsys.readouterr().err


def test_generate_with_the_engine_equals_the_hf_path(capsys):
    """--engine dense gives the Hugging Face full-attention path's greedy text; --engine auto with a
    threshold above the prompt picks dense."""
    args = ["--max-new-tokens", "5", "--prompt", "Name three colours of the rainbow.", "--json"]
    assert main(["generate", "--method", "full", *args]) == 0
    hf = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["generate", "--engine", "dense", *args]) == 0
    eng = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert eng["text"] == hf["text"] and eng["method"] == "dense" and eng["backend"] == "torch"
    assert main(["generate", "--engine", "auto", "--auto-min-context", "100000", *args]) == 0
    auto = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert auto["method"] == "dense" and auto["text"] == hf["text"]
    assert main(["generate", "--engine", "dense", "--compile", *args]) == 0  # compiled pieces: the same text
    comp = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert comp["compiled"] and not eng["compiled"] and comp["text"] == hf["text"]


def test_generate_engine_rejects_options_it_does_not_take(capsys):
    assert main(["generate", "--engine", "locks", "--sample", "--prompt", "x"]) == 2
    assert "--sample" in capsys.readouterr().err
    assert main(["generate", "--engine", "locks", "--method", "quest", "--prompt", "x"]) == 2
    assert "--method" in capsys.readouterr().err
    assert main(["generate", "--auto-min-context", "5", "--prompt", "x"]) == 2
    assert "--engine auto" in capsys.readouterr().err
    assert main(["generate", "--compile", "--prompt", "x"]) == 2
    assert "--compile applies to --engine only" in capsys.readouterr().err
