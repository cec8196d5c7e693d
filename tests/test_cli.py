"""The ``kvlocks`` command as a user runs it: help, checks before the model loads, quiet output,
progress, and the bundled model end to end (CPU)."""

import io
import json
import warnings

import pytest
import torch
from safetensors.torch import save_file

from kvlocks.cli import build_parser, main
from kvlocks.commands.common import Progress, add_original_fractions, bytes_line

PRODUCT_COMMANDS = ("demo", "generate", "compact")


def _subparsers(parser):
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices


def test_generate_offers_every_method_of_the_hf_path():
    from kvlocks.integrations.hf import method_names

    method = next(a for a in _subparsers(build_parser())["generate"]._actions if a.dest == "method")
    assert tuple(method.choices) == method_names()


def test_every_option_has_help_and_shows_its_default():
    subs = _subparsers(build_parser())
    for name in PRODUCT_COMMANDS:
        p = subs[name]
        text = " ".join(p.format_help().split())
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[-1]
            assert action.help, f"kvlocks {name} {flag} has no help text"
            if action.default is not None and action.default is not False:
                assert f"(default: {action.default})" in text, f"kvlocks {name} {flag}: default not shown"
            elif action.nargs != 0 and action.dest in ("budget", "rank", "basis_bits", "combine", "temperature"):
                assert "default: " in action.help, f"kvlocks {name} {flag}: default not shown"
    gen = " ".join(subs["generate"].format_help().split())
    assert "(default: 256; not used by --method full)" in gen and "(default: 8)" in gen


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to load a model fails the test: every check must come first."""
    import kvlocks.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvlocks.models, "load", refuse)


def _cache_file(path, **meta):
    from kvlocks.compaction.cachefile import FORMAT, FORMAT_VERSION

    full = {"format": FORMAT, "format_version": FORMAT_VERSION, "T": "100", "t": "10", "method": "fold",
            "model_id": "smollm2-135m", **meta}
    save_file({"x": torch.zeros(1)}, str(path), metadata={k: v for k, v in full.items() if v is not None})
    return path


def _bad_cases(tmp):
    empty = tmp / "empty.txt"
    empty.write_text("  \n")
    doc = tmp / "doc.txt"
    doc.write_text("some text")
    junk = tmp / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    other = tmp / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(other))
    gpt2 = tmp / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    bad_json = tmp / "bad.json"
    bad_json.write_text('[{"role": "user", "content": "hi"')
    assistant_last = tmp / "assistant_last.json"
    assistant_last.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]))
    no_content = tmp / "no_content.json"
    no_content.write_text(json.dumps({"messages": [{"role": "user"}]}))
    g = ["generate", "--prompt", "x"]
    return [
        (["generate", "--chat", str(bad_json)], "not valid JSON"),
        (["generate", "--chat", str(assistant_last)], "the last message must be a non-empty user message"),
        (["generate", "--chat", str(no_content)], "message 0 must be"),
        (["generate", "--chat", str(assistant_last), "--raw"], "--chat is rendered with the chat template"),
        (["generate", "--chat", str(tmp / "missing.json")], "no such file"),
        (g + ["--method", "full,locks", "--cache", str(_cache_file(tmp / "f.safetensors"))], "drop --cache"),
        (g + ["--cache", str(tmp / "missing.safetensors")], "no such file"),
        (g + ["--cache", str(junk)], "not a readable safetensors file"),
        (g + ["--cache", str(other)], "format=None"),
        (g + ["--cache", str(_cache_file(tmp / "v9.safetensors", format_version="9"))], "format_version='9'"),
        (g + ["--cache", str(_cache_file(tmp / "nt.safetensors", T=None))], "lacks ['T']"),
        (g + ["--cache", str(_cache_file(tmp / "am.safetensors", method="am")), "--method", "locks"], "logit bias"),
        (g + ["--cache", str(_cache_file(tmp / "gone.safetensors", model_id="/no/such/model"))], "pass --model"),
        (g + ["--method", "full", "--budget", "256"], "--budget would be unused"),
        (g + ["--method", "full", "--rank", "4", "--combine", "max_share"], "--rank, --combine would be unused"),
        (g + ["--engine", "dense", "--budget", "128"], "--engine dense attends every token"),
        (g + ["--budget", "40"], "budget=40"),
        (g + ["--rank", "17"], "rank=17"),
        (g + ["--temperature", "0.5"], "--temperature applies to --sample only"),
        (g + ["--sample", "--temperature", "0"], "--temperature=0.0: must be > 0"),
        (g + ["--engine", "locks", "--auto-min-context", "5"], "--engine auto only"),
        (g + ["--max-new-tokens", "0"], "--max-new-tokens=0"),
        (g + ["--device", "cuda"], "no CUDA device is visible"),
        (g + ["--device", "cuda:1"], "no CUDA device is visible"),
        (g + ["--device", "gpu"], "'gpu' is not a device torch knows"),
        (g + ["--model", str(tmp)], "is neither a bundled model"),
        (g + ["--model", str(gpt2)], "model_type 'gpt2' is not supported"),
        (["generate", "--prompt-file", str(tmp / "missing.txt")], "no such file"),
        (["generate", "--prompt-file", str(empty)], "is empty"),
        (["generate", "--prompt", "   "], "empty"),
        (["compact", "--input", str(tmp / "missing.txt"), "--out", str(tmp / "o.safetensors")], "no such file"),
        (["compact", "--input", str(empty), "--out", str(tmp / "o.safetensors")], "is empty"),
        (["compact", "--input", str(doc), "--out", str(tmp)], "is a directory"),
        (["compact", "--input", str(doc), "--out", str(doc / "o.safetensors")], "is not a directory"),
        (["compact", "--input", str(doc), "--out", str(tmp / "o.st"), "--ratio", "0"], "ratio"),
        (["compact", "--input", str(doc), "--out", str(tmp / "o.st"), "--max-tokens", "0"], "--max-tokens=0"),
        (["compact", "--input", str(doc), "--out", str(tmp / "o.st"), "--device", "cuda"], "no CUDA device"),
        (["demo", "--budget", "40"], "budget=40"),
        (["demo", "--out", str(tmp)], "is a directory"),
        (["demo", "--device", "cuda:0"], "no CUDA device is visible"),
    ]


def test_bad_arguments_and_files_are_reported_before_the_model_loads(no_model, tmp_path, capsys):
    for argv, message in _bad_cases(tmp_path):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith(f"kvlocks {argv[0]}: error: "), (argv, err)
        assert "Traceback" not in err


def test_a_bad_argument_is_reported_without_importing_transformers():
    """The checks need torch only: an error comes in the time of ``import torch``, not of a load."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvlocks.cli import main\n"
            "assert main(['generate', '--device', 'cuda:7', '--prompt', 'x']) == 2\n"
            "assert main(['demo', '--budget', '40']) == 2\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "cuda:7" in res.stderr and "budget=40" in res.stderr


def test_argparse_refuses_bad_choices_at_once(no_model, capsys):
    for argv, message in ((["generate", "--prompt", "x", "--basis-bits", "3"], "--basis-bits: invalid choice"),
                          (["generate", "--prompt", "x", "--combine", "avg"], "--combine: invalid choice"),
                          (["generate", "--prompt", "x", "--method", "lock"], "--method: invalid choice"),
                          (["generate", "--prompt", "x", "--method", "full,lock"], "--method: invalid choice"),
                          (["generate", "--prompt", "x", "--method", "full,full"], "--method: invalid choice")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cuda_device_checks(monkeypatch):
    from kvlocks.models import check_device

    assert check_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device is visible.*use --device cpu"):
            check_device("cuda", name="--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device='cuda:2': only 2 CUDA device\(s\) visible \(cuda:0 .. cuda:1\)"):
        check_device("cuda:2")
    with pytest.raises(ValueError, match="not a device torch knows"):
        check_device("cuda:x")


def test_progress_is_plain_lines_off_a_terminal():
    out = io.StringIO()
    bar = Progress(3, "methods", "method", stream=out, every=0.0)
    for i, name in enumerate(("full", "locks", "oracle")):
        bar.update(i, name)
    bar.update(3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 4
    assert lines[0].startswith("methods 0/3: full (") and lines[1].startswith("methods 1/3: locks")
    assert lines[-1].startswith("methods 3/3 (")
    quiet = io.StringIO()
    bar = Progress(30, "compact", "step", stream=quiet)  # throttled: first and last only, within 5 s
    for i in range(31):
        bar.update(i, f"layer {i}")
    assert len(quiet.getvalue().splitlines()) == 2


def test_quiet_holds_back_library_output_unless_it_fails(capfd):
    import logging

    from tqdm.auto import tqdm

    from kvlocks.models import quiet

    def noisy():
        for _ in tqdm(range(3), desc="Loading weights"):
            pass
        warnings.warn("a library warning")
        logging.getLogger("transformers.modeling_utils").warning("a transformers warning")

    with quiet():
        noisy()
    assert capfd.readouterr().err == ""
    with pytest.raises(RuntimeError), quiet():
        noisy()
        raise RuntimeError("boom")
    assert "Loading weights" in capfd.readouterr().err  # replayed: the failure keeps its context


def test_original_prefix_fractions_scale_with_the_logical_context():
    # 2 decode steps at physical contexts 11 and 12 (t = 10 entries + 1, + 2): mean 11.5 entries
    stats = {"decode_steps": 2, "pages_selected": 1.0, "tokens_attended": 11.5, "context_tokens": 11.5,
             "selection_bytes": 0.0, "kv_bytes": 92.0, "bytes_read": 92.0, "full_bytes": 92.0,
             "read_fraction": 1.0}
    out = add_original_fractions(stats, 100, 10)  # T = 100: logical contexts 101 and 102
    assert out["original_full_bytes"] == pytest.approx(92.0 * 101.5 / 11.5)
    assert out["original_read_fraction"] == pytest.approx(11.5 / 101.5)
    line = bytes_line(out, original={"T": 100, "t": 10})
    assert "(100.0%) over the compacted cache" in line and "(11.3%) over the original 100-token prefix" in line


def test_original_prefix_fractions_of_a_hybrid_model_grow_only_the_global_layers():
    from kvlocks.integrations.hf.stats import DecodeStats

    st = DecodeStats()  # one step: a window layer reading its 4 tokens (8 bytes each), a dense global one 11
    st.add(0, kind="window", pages=1, tokens=4, context=100, selection_bytes=0.0, kv_bytes=32.0, full_bytes=32.0)
    st.add(1, kind="dense", pages=1, tokens=11, context=11, selection_bytes=0.0, kv_bytes=88.0, full_bytes=88.0)
    out = add_original_fractions(st.summary(), 100, 10)  # T = 100 tokens held as t = 10 in the global layer
    assert out["original_full_bytes"] == pytest.approx((32.0 + 8.0 * 101) / 2)  # the window read stays 32
    assert out["original_read_fraction"] == pytest.approx(60.0 / ((32.0 + 808.0) / 2))
    assert "layers per step: 1 dense, 1 window" in bytes_line(out, original={"T": 100, "t": 10})


@pytest.mark.model
@pytest.mark.parametrize("method,flags,rerank", [
    ("locks", [], 0), ("loki", [], 0), ("locks_rerank", [], 4),
    ("locks", ["--rerank", "2", "--rerank-scores", "centroid"], 2),  # the Hugging Face path's decode plan
    ("locks_centroid", ["--rerank", "3"], 3),  # the mode's other fields; the flag given wins
])
def test_generate_json(method, flags, rerank, capsys):
    rc = main(["generate", "--method", method, "--budget", "32", "--max-new-tokens", "3",
               "--prompt", "Name a colour.", "--json", *flags])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["method"] == method and out["config"]["budget"] == 32
    assert out["config"]["rerank"] == rerank  # the configuration the method ran
    assert out["config"]["rerank_scores"] == ("centroid" if "centroid" in method + " ".join(flags) else "summary")
    assert out["stats"]["decode_steps"] >= 1 and out["stats"]["pages_selected"] <= 2


@pytest.mark.model
def test_loading_is_quiet_one_line_and_no_carriage_returns(capfd):
    assert main(["generate", "--max-new-tokens", "2", "--prompt", "Name a colour."]) == 0
    err = capfd.readouterr().err
    assert "\r" not in err and "Loading weights" not in err and "Warning" not in err, err
    assert err.count("loading smollm2-135m") == 1, err


@pytest.mark.model
def test_demo_methods_progress_moves_per_method(monkeypatch, capfd):
    """The demo's display advances as each method finishes (run_demo's own callback, real
    tokenizer and document; the decode is stubbed so that the test takes seconds)."""
    import kvlocks.demo
    from kvlocks.commands import demo as demo_cmd
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    seen = []

    class Result:
        tokens = tok("4817.", add_special_tokens=False).input_ids

    def fake_answer(model, cache, ctx, suffix, **kw):
        seen.append(cache.method if hasattr(cache, "method") else None)
        return Result()

    monkeypatch.setattr(kvlocks.demo, "greedy_answer", fake_answer)
    monkeypatch.setattr(demo_cmd, "load_model", lambda args: (model, tok))
    capfd.readouterr()
    assert main(["demo"]) == 0
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("methods ")]
    assert [line.split(":")[0].split(" (")[0] for line in lines] == [
        "methods 0/3", "methods 1/3", "methods 2/3", "methods 3/3"], err
    assert "\r" not in err and len(seen) == 3


@pytest.mark.model
def test_generate_from_a_cache_reports_both_fractions(tmp_path, capsys):
    from kvlocks.corpus import natural_units

    text = tmp_path / "doc.txt"
    text.write_text("".join(natural_units()[:20]))
    out = tmp_path / "cache.safetensors"
    assert main(["compact", "--input", str(text), "--ratio", "0.25", "--out", str(out), "--max-tokens", "128",
                 "--max-queries", "256", "--self-study-tokens", "0", "--no-repeat", "--json"]) == 0
    capsys.readouterr()
    args = ["generate", "--cache", str(out), "--prompt", "What is it about?", "--raw", "--method", "full",
            "--max-new-tokens", "4"]
    assert main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    big, small, st = res["prefix"]["T"], res["prefix"]["t"], res["stats"]
    assert (big, small) == (128, 32)
    # full attention reads every entry: all of the compacted cache, t / T of the original prefix
    assert st["read_fraction"] == pytest.approx(1.0)
    ctx = st["context_tokens"]  # mean physical entries per step: t + appended
    hkv, d, elem = 3, 64, 4  # bundled model, fp32
    assert st["original_full_bytes"] == pytest.approx(2 * hkv * d * elem * (ctx + big - small))
    assert st["original_read_fraction"] == pytest.approx(ctx / (ctx + big - small))
    assert main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(100.0%) over the compacted cache" in line
    assert f"({100 * st['original_read_fraction']:.1f}%) over the original 128-token prefix" in line


@pytest.mark.model
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


def test_generate_engine_rejects_options_it_does_not_take(no_model, capsys):
    assert main(["generate", "--engine", "locks", "--sample", "--prompt", "x"]) == 2
    assert "--sample" in capsys.readouterr().err
    assert main(["generate", "--engine", "locks", "--method", "quest", "--prompt", "x"]) == 2
    assert "--method" in capsys.readouterr().err
    assert main(["generate", "--auto-min-context", "5", "--prompt", "x"]) == 2
    assert "--engine auto" in capsys.readouterr().err
    assert main(["generate", "--compile", "--prompt", "x"]) == 2
    assert "--compile applies to --engine only" in capsys.readouterr().err


def _bench_args(argv):
    import argparse

    bench = pytest.importorskip("kvlocks_lab.commands.bench")
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
    pytest.importorskip("kvlocks_lab.commands.bench")
    assert main(["bench", "e2e", "--out", "x", "--batches", "2,0"]) == 2
    assert "E2EBenchConfig.batches=0" in capsys.readouterr().err
    assert main(["bench", "kernels", "--out", "x", "--shapes", "gpt2"]) == 2
    assert "gpt2" in capsys.readouterr().err


def test_the_test_command_shows_counts_per_file():
    """scripts/test.sh runs pytest with a line per file and ends with a per-file table
    (tests/conftest.py's --file-summary); .ci/run calls exactly that script."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "test.sh").read_text()
    assert "console_output_style=count" in script and "--file-summary" in script
    assert re.search(r"^bash scripts/test\.sh$", (root / ".ci" / "run").read_text(), re.M)
    res = subprocess.run([sys.executable, "-m", "pytest", "tests/test_api_errors.py", "-o", "console_output_style=count",
                          "--file-summary", "-p", "no:cacheprovider", "-k", "nan"], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:]
    assert re.search(r"^tests/test_api_errors\.py \.+ +\[ *6/6\]$", res.stdout, re.M), res.stdout
    assert re.search(r"^tests/test_api_errors\.py +6 passed +0 failed +0 skipped +[\d.]+ s$", res.stdout, re.M), res.stdout


@pytest.mark.model
def test_generate_several_methods_from_one_prefill_with_chat_and_answer_prefix(tmp_path, capsys):
    """--method full,locks,oracle on a --chat file: at a budget covering the prompt every method
    gives full's answer, and full's equals a one-method run; at a small budget a table compares them."""
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps({"messages": [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Tom's kite is red and Ann's boat is green. What colour is Tom's kite?"}]}))
    args = ["--chat", str(chat), "--answer-prefix", "Tom's kite is", "--max-new-tokens", "3", "--json"]
    assert main(["generate", "--method", "full,locks,oracle", "--budget", "1024", *args]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    texts = {r["method"]: r["text"] for r in out["methods"]}
    assert list(texts) == ["full", "locks", "oracle"] and len(set(texts.values())) == 1, texts
    assert [r["config"]["budget"] for r in out["methods"]] == [1024] * 3
    assert out["answer_prefix"] == "Tom's kite is" and out["methods"][1]["stats"]["read_fraction"] > 1
    assert main(["generate", "--method", "full", *args]) == 0
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert single["text"] == texts["full"]
    assert main(["generate", "--method", "full,locks", "--budget", "32", *args[:-1]]) == 0
    table = capsys.readouterr().out
    assert "| method | attended / context tokens |" in table
    rows = [line for line in table.splitlines() if line.startswith("| full |") or line.startswith("| locks |")]
    assert len(rows) == 2 and "| 100.0 |" in rows[0]


def test_demo_writes_its_document_for_compact_and_generate(tmp_path, capsys):
    from kvlocks.demo import ANSWER, FACT, QUESTION

    doc = tmp_path / "doc.txt"
    assert main(["demo", "--write-document", str(doc)]) == 0
    text = doc.read_text()
    assert text.count(FACT) == 1 and ANSWER in FACT
    out = capsys.readouterr().out
    assert QUESTION in out and "tokens" in out
