"""Compaction methods in the task suite: spelling, fits shared per record, serving, resume (CPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kvlocks_lab.eval.compacted import CompactionSettings, RecordCompactions, compaction_stats, derive
from kvlocks_lab.eval.methods import parse_method, parse_methods
from kvlocks_lab.eval.suite import EvalConfig

SETTINGS = CompactionSettings(max_queries=64, self_study_tokens=2)


# --- method spelling (no model) ---------------------------------------------------------------


def test_method_spelling_is_parsed_and_canonical():
    s = parse_method("fold@0.10")
    assert (s.name, s.kind, s.base, s.ratio, s.budgeted) == ("fold@0.1", "compaction", "fold", 0.1, False)
    assert parse_method("am@1").name == "am@1" and parse_method("am@1").ratio == 1.0
    assert parse_method("locks").budgeted and parse_method("full").kind == "full"
    cfg = EvalConfig(methods=("full", "drop@0.050", "locks"))
    assert cfg.methods == ("full", "drop@0.05", "locks")
    assert cfg.runs_per_record() == 1 + 1 + len(cfg.budgets)


def test_compaction_plus_selector_spelling():
    s = parse_method("fold@0.10+locks")
    assert (s.name, s.kind, s.base, s.ratio, s.selector, s.budgeted) == (
        "fold@0.1+locks", "compaction", "fold", 0.1, "locks", True)
    cfg = EvalConfig(methods=("full", "fold@0.1", "fold@0.1+locks"))
    assert cfg.runs_per_record() == 1 + 1 + len(cfg.budgets)


@pytest.mark.parametrize("text,needle", [
    ("am@0.1+locks", "logit bias"), ("rank1@0.1+locks", "logit bias"), ("fold@0.1+full", "not a selector"),
    ("fold@0.1+bogus", "not a selector"), ("locks+fold", "not NAME@RATIO"),
])
def test_bad_compaction_plus_selector_spellings(text, needle):
    with pytest.raises(ValueError) as err:
        parse_method(text)
    assert needle in str(err.value)


@pytest.mark.parametrize("text,needle", [
    ("fold", "fold@0.1"),  # a compaction needs its ratio, and the message shows how
    ("fold@0", "(0, 1]"), ("fold@1.5", "(0, 1]"), ("fold@nan", "(0, 1]"), ("fold@x", "not a number"),
    ("locks@0.1", "not a compaction method"), ("bogus", "allowed"), ("", "non-empty"),
])
def test_bad_method_spellings_say_what_is_allowed(text, needle):
    with pytest.raises(ValueError) as err:
        parse_method(text)
    assert needle in str(err.value)


def test_duplicate_methods_after_canonicalisation_are_rejected():
    with pytest.raises(ValueError, match="more than once"):
        parse_methods(["fold@0.1", "fold@0.10"])
    with pytest.raises(ValueError, match="EvalConfig.methods"):
        EvalConfig(methods=("full", "fold"))


@pytest.mark.parametrize("args,needle", [
    (["--methods", "full,fold"], "fold@0.1"), (["--methods", "full,fold@2"], "(0, 1]"),
    (["--tasks", "ppl"], "ppl_continuation"), (["--ppl-tokens", "2000", "--lengths", "2048"], "ppl_tokens"),
    (["--compaction-max-queries", "0"], "compaction_max_queries"),
])
def test_cli_rejects_bad_grids_before_loading_anything(tmp_path, capsys, args, needle):
    from kvlocks.cli import main

    assert main(["eval", *args, "--out", str(tmp_path / "run")]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_compaction_stats_count_kept_plus_decoded_tokens():
    info = SimpleNamespace(num_kv_heads=3, head_dim=64)
    prefix = SimpleNamespace(model=info, kept=10, prefix_len=100, has_bias=True)
    cache = SimpleNamespace(physical_length=lambda: 14)  # 4 decode steps: 11, 12, 13, 14 entries
    st = compaction_stats(cache, prefix, elem_size=4)
    assert st["decode_steps"] == 4 and st["tokens_attended"] == 12.5 and st["context_tokens"] == 102.5
    per_token = 2 * 3 * 64 * 4
    assert st["kv_bytes"] == per_token * 12.5 and st["bias_bytes"] == 3 * 10 * 4
    assert st["read_fraction"] == pytest.approx((per_token * 12.5 + 120) / (per_token * 102.5))


# --- on the bundled model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


@pytest.fixture(scope="module")
def prefix_ids(model_tok):
    from kvlocks.corpus import natural_units

    _, tok = model_tok
    return tok("".join(natural_units()[:30]), add_special_tokens=False).input_ids[:160]


@pytest.fixture(scope="module")
def rc(model_tok, prefix_ids):
    """One record's compactions, shared by the tests below (one capture)."""
    model, tok = model_tok
    return RecordCompactions(model, tok, prefix_ids, SETTINGS)


@pytest.mark.model
def test_am_drop_rank1_from_one_fit_equal_direct_compaction(model_tok, prefix_ids, rc):
    from kvlocks.integrations.hf.compaction.model import compact_capture

    model, tok = model_tok
    with torch.inference_mode():
        am = rc.get("am", 0.25)
        for method in ("drop", "rank1"):
            direct = compact_capture(model, rc.capture(), SETTINGS.config(method, 0.25), reference=SETTINGS.reference())
            got = rc.get(method, 0.25)
            assert got.method == direct.method and got.config == direct.config and got.kept == direct.kept
            assert (got.beta is None) == (direct.beta is None)
            for a, b in zip(got.keys + got.values + got.indices, direct.keys + direct.values + direct.indices):
                assert torch.equal(a, b)
    assert am.kept == round(0.25 * len(prefix_ids)) and ("drop", 0.25) not in rc._made  # one fit
    with pytest.raises(ValueError, match="only"):
        derive(am, "fold")


@pytest.mark.model
def test_fits_are_saved_reloaded_without_refitting_and_cleaned_up(model_tok, prefix_ids, tmp_path, monkeypatch):
    import kvlocks.integrations.hf.compaction.model as cmodel

    model, tok = model_tok
    with torch.inference_mode():
        first = RecordCompactions(model, tok, prefix_ids, SETTINGS, cache_dir=tmp_path, tag="r0")
        made = first.get("fold", 0.25)
        files = sorted(p.name for p in tmp_path.iterdir())
        assert files == ["r0-fold@0.25.safetensors"]
        monkeypatch.setattr(cmodel, "compact_capture", lambda *a, **k: pytest.fail("refitted"))
        again = RecordCompactions(model, tok, prefix_ids, SETTINGS, cache_dir=tmp_path, tag="r0")
        loaded = again.get("fold", 0.25)
        assert all(torch.equal(a, b) for a, b in zip(made.keys + made.values, loaded.keys + loaded.values))
        # other settings: the saved fit is not reused
        other = RecordCompactions(model, tok, prefix_ids, SETTINGS.replace(max_queries=32), cache_dir=tmp_path, tag="r0")
        with pytest.raises(pytest.fail.Exception, match="refitted"):
            other.get("fold", 0.25)
    again.cleanup()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.model
def test_decoding_over_a_compacted_cache_continues_at_position_T(model_tok, prefix_ids, rc):
    """Token-by-token steps over the served cache give serve.generate's greedy tokens (ratio 0.5)."""
    from kvlocks.integrations.hf.compaction import serve
    from kvlocks.integrations.hf.decode import step
    from kvlocks_lab.eval.shared_prefill import SharedPrefill

    model, tok = model_tok
    new = tok("\n\nIn one sentence, what is the text above about?\n", add_special_tokens=False).input_ids
    with torch.inference_mode():
        shared = SharedPrefill(model, prefix_ids, EvalConfig().locks_config(64), (64,), compactions=rc)
        opened = shared.open(parse_method("fold@0.5"), None)
        assert opened.cache.get_seq_length() == len(prefix_ids)  # logical length T, not t
        for t in new:
            logits = step(model, opened.cache, t)
        tokens = []
        for _ in range(6):
            tokens.append(int(logits.argmax()))
            logits = step(model, opened.cache, tokens[-1])
        want = serve.generate(model, serve.to_cache(model, rc.get("fold", 0.5)), torch.tensor([new]),
                              max_new_tokens=6, do_sample=False)
    assert tokens == want[0].tolist()


@pytest.mark.model
def test_ratio_one_keeps_everything_and_matches_full(model_tok):
    from kvlocks_lab.eval.runner import run_record
    from kvlocks_lab.eval.tasks import generate

    model, tok = model_tok
    record = generate("passkey", tok, 256, 1)[0]
    rows = []
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    with torch.inference_mode():
        run_record(model, tok, record, ("full", "fold@1", "am@1"), (64,), EvalConfig().locks_config(64), eos, {},
                   rows.append, compaction=SETTINGS)
    by = {r["method"]: r for r in rows}
    full = by["full"]
    for method in ("fold@1", "am@1"):
        comp = by[method]
        assert comp["kept"] == comp["prefix_tokens"] == len(record.context_ids) and comp["budget"] is None
        assert comp["tokens"] == full["tokens"] and comp["exact_agree"] == 1 and comp["score"] == full["score"]
        assert comp["kl"] < 1e-6 and comp["top1"] == 1
        # every entry is read; am also reads its (zero) bias: one value per key against 2 * 64 for K and V
        assert comp["stats_read_fraction"] == pytest.approx(1.0 + (1 / 128 if method == "am@1" else 0.0), rel=1e-3)
    assert model.config._attn_implementation == "kvlocks"  # the bias-aware attention was switched back


@pytest.mark.model
def test_selector_over_a_compacted_cache_runs_per_budget(model_tok):
    """fold@1+locks: at a budget covering the whole cache it is exactly full; at a small budget it
    reads fewer bytes than full, counted against the uncompacted context."""
    from kvlocks_lab.eval.runner import run_record
    from kvlocks_lab.eval.tasks import generate

    model, tok = model_tok
    record = generate("passkey", tok, 256, 1)[0]
    rows = []
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    with torch.inference_mode():
        run_record(model, tok, record, ("full", "fold@1+locks"), (32, 512), EvalConfig().locks_config(32), eos, {},
                   rows.append, compaction=SETTINGS)
    by = {(r["method"], r["budget"]): r for r in rows}
    assert set(by) == {("full", None), ("fold@1+locks", 32), ("fold@1+locks", 512)}
    full, big, small = by[("full", None)], by[("fold@1+locks", 512)], by[("fold@1+locks", 32)]
    assert big["kept"] == big["prefix_tokens"] == len(record.context_ids)
    assert big["tokens"] == full["tokens"] and big["kl"] < 1e-6 and big["top1"] == 1
    assert small["stats_read_fraction"] < 0.6 < big["stats_read_fraction"]
    for r in (small, big):  # full's context: the T uncompacted tokens plus the mean of those decoded so far
        assert r["stats_context_tokens"] == pytest.approx(r["prefix_tokens"] + (r["stats_decode_steps"] + 1) / 2)


@pytest.mark.model
def test_fork_of_a_locks_cache_over_a_compacted_prefix_continues_at_position_T(model_tok, prefix_ids, rc):
    """``kvlocks eval`` forks a method's cache at its first divergence from full's answer and
    teacher-forces the fork. A fork of a LOCKS cache over a folded prefix must keep positions
    at T + n (not the physical t + n): at a budget covering every page, the fork's logits equal
    stock SDPA over the plain compacted cache (an independent path: DynamicCache, deep copy)."""
    import copy

    from kvlocks.integrations.hf.compaction import serve
    from kvlocks.config import LocksConfig
    from kvlocks.integrations.hf.decode import step
    from kvlocks_lab.eval.shared_prefill import fork_cache

    model, tok = model_tok
    prefix = rc.get("fold", 0.5)
    assert prefix.kept < prefix.prefix_len == len(prefix_ids)
    first = tok(" The text above", add_special_tokens=False).input_ids
    then = tok(" is about a town and its river.", add_special_tokens=False).input_ids
    with torch.inference_mode():
        dense = serve.to_cache(model, prefix)
        sparse = serve.to_locks_cache(model, prefix, method="locks", config=LocksConfig(budget=256))
        assert prefix.kept + len(first) + len(then) <= 256  # every page attended: exact
        for t in first:
            step(model, dense, t)
            step(model, sparse, t)
        fork, ref = fork_cache(sparse), copy.deepcopy(dense)
        assert fork.get_seq_length() == len(prefix_ids) + len(first)
        assert fork.physical_length() == prefix.kept + len(first)
        for t in then:
            got, want = step(model, fork, t), step(model, ref, t)
            assert torch.allclose(got, want, atol=1e-3, rtol=0), float((got - want).abs().max())
        # the fork is independent of the cache it came from
        assert sparse.get_seq_length() == len(prefix_ids) + len(first)
        small = sparse.fork(method="oracle", config=LocksConfig(budget=32))
        assert small.get_seq_length() == len(prefix_ids) + len(first) and small.method == "oracle"


@pytest.mark.model
def test_selector_over_a_compacted_cache_at_a_covering_budget_equals_the_compacted_cache(model_tok):
    """fold@0.5+locks at a budget above every page gives fold@0.5's tokens and KL to full, also
    after the answer left full's (the runner then teacher-forces a fork of each cache)."""
    from kvlocks_lab.eval.runner import run_record
    from kvlocks_lab.eval.tasks import generate

    model, tok = model_tok
    record = generate("niah_single_noise", tok, 256, 1)[0]
    rows = []
    eos = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    with torch.inference_mode():
        run_record(model, tok, record, ("full", "fold@0.5", "fold@0.5+locks"), (512,),
                   EvalConfig().locks_config(512), eos, {}, rows.append, compaction=SETTINGS)
    by = {r["method"]: r for r in rows}
    fold, both = by["fold@0.5"], by["fold@0.5+locks"]
    assert fold["exact_agree"] < 1  # left full's answer: the forked, teacher-forced path is exercised
    assert both["tokens"] == fold["tokens"] and both["top1"] == fold["top1"]
    assert both["kl"] == pytest.approx(fold["kl"], rel=1e-3, abs=1e-5)


@pytest.mark.model
def test_cli_end_to_end_with_compaction_and_ppl(model_tok, tmp_path):
    from kvlocks.cli import main

    out = tmp_path / "run"
    argv = ["eval", "--tasks", "passkey,ppl_continuation", "--lengths", "256", "--budgets", "32",
            "--methods", "full,locks,fold@0.5", "--samples", "1", "--ppl-tokens", "16",
            "--compaction-max-queries", "64", "--compaction-self-study-tokens", "2", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"config", "commit", "device", "versions", "n_rows", "headline", "cells", "perplexity"} <= set(summary)
    assert summary["n_rows"] == 6 and summary["config"]["methods"] == ["full", "locks", "fold@0.5"]
    cells = {(c["task"], c["method"], c["budget"]): c for c in summary["cells"]}
    assert set(cells) == {("passkey", "full", None), ("passkey", "locks", 32), ("passkey", "fold@0.5", None)}
    fold = cells[("passkey", "fold@0.5", None)]
    assert fold["ratio"] == 0.5 and fold["kept"] > 0 and fold["compact_s"] > 0 and fold["n"] == 1
    for key in ("score", "strict", "exact_agree", "agree16", "kl", "top1", "stats_read_fraction", "diff_vs_full"):
        assert key in fold
    ppl = {(c["method"], c["budget"]): c for c in summary["perplexity"]}
    assert set(ppl) == {("full", None), ("locks", 32), ("fold@0.5", None)}
    for c in ppl.values():
        assert c["task"] == "ppl_continuation" and c["length"] == 256 and c["n"] == 1 and c["ppl"] > 1
        assert c["new_tokens"] == 16
    assert ppl[("full", None)]["ppl_diff_vs_full"] is None and ppl[("full", None)]["ppl_ratio_vs_full"] == 1.0
    for key in ("ppl_diff_vs_full", "nll_diff_vs_full"):
        assert set(ppl[("locks", 32)][key]) == {"mean", "low", "high", "n"}
    heads = {(h["method"], h["budget"]) for h in summary["headline"]}
    assert heads == {("full", None), ("locks", 32), ("fold@0.5", None)}
    md = (out / "results.md").read_text()
    assert "fold@0.5" in md and "Perplexity of natural-text continuations" in md
    for f in ("score_vs_budget.png", "kl_vs_budget.png", "depth_heatmap.png", "ppl_vs_budget.png"):
        assert (out / f).exists()
    assert list((out / "compacted").iterdir()) == []  # fits are removed once their record is done
    # resume: nothing is recomputed or duplicated
    assert main(argv) == 0
    assert len((out / "rows.jsonl").read_text().splitlines()) == 6
