"""Model-level compaction on the bundled model: capture, compact, file, serving, CLI (fp32, CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import re
import subprocess
import sys

import hostile_files
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from kvlocks.compaction import CompactionConfig, exact_attention
from kvlocks.compaction import cachefile
from kvlocks.integrations.hf.compaction import attention as compact_attn
from kvlocks.integrations.hf.compaction import serve
from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.compaction.prefix import check_model
from kvlocks.integrations.hf.compaction.model import compact_capture
from kvlocks.integrations.hf.compaction.passes import QueryPass, ReferenceConfig, reference_passes
from kvlocks.config import LocksConfig
from kvlocks.integrations.hf import cache_kwargs
from kvlocks.corpus import natural_units

pytestmark = pytest.mark.model

T = 256
REF = ReferenceConfig(self_study_tokens=4)
QUESTION = "\n\nIn one sentence, what is the text above about?\n"


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


@pytest.fixture(scope="module")
def setup(model_tok):
    """Prefix [1, T], continuation [1, L], a capture (with held-out queries) and compactions."""
    model, tok = model_tok
    units = natural_units()
    prefix = tok("".join(units[:40]), return_tensors="pt", add_special_tokens=False).input_ids[:, :T]
    new = tok(QUESTION, return_tensors="pt", add_special_tokens=False).input_ids
    heldout = tok("".join(units[200:230]), return_tensors="pt", add_special_tokens=False).input_ids[:, :96]
    passes = reference_passes(tok, prefix, REF) + [QueryPass("heldout", heldout)]
    cap = capture_queries(model, prefix, passes, max_queries=512, seed=0)
    ref_cap = cap.only([n for n in cap.by_pass if n != "heldout"])  # held-out queries stay unseen
    made = {m: compact_capture(model, ref_cap, CompactionConfig(method=m, ratio=0.1, max_queries=512),
                               reference=REF) for m in ("fold", "am")}
    # drop is AM's keys and values with beta discarded: no second fit needed
    made["drop"] = dataclasses.replace(made["am"], beta=None, method="drop",
                                       config=made["am"].config.replace(method="drop"))
    return {"prefix": prefix, "new": new, "cap": cap, "ref_cap": ref_cap, "made": made,
            "uncompacted": _uncompacted(model, prefix, new),
            "fold_tokens": _greedy(model, serve.to_cache(model, made["fold"]), new)}


def _greedy(model, cache, new, n=8):
    return serve.generate(model, cache, new, max_new_tokens=n, do_sample=False)


def _uncompacted(model, prefix, new, n=8):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prefix, cache=cache, use_cache=True)
    out = model.generate(input_ids=torch.cat([prefix, new], 1), max_new_tokens=n, do_sample=False,
                         **cache_kwargs(model, cache))
    return out[:, prefix.shape[1] + new.shape[1]:]


@pytest.mark.parametrize("method", ["fold", "am"])
def test_ratio_one_file_round_trip_gives_uncompacted_tokens(model_tok, setup, tmp_path, method):
    model, _ = model_tok
    prefix = compact_capture(model, setup["ref_cap"], CompactionConfig(method=method, ratio=1.0))
    assert prefix.kept == T
    path = cachefile.save(tmp_path / "c.safetensors", prefix)
    cache = serve.to_cache(model, cachefile.load(path, model))
    assert torch.equal(_greedy(model, cache, setup["new"]), setup["uncompacted"])


def test_new_tokens_continue_at_position_T(model_tok, setup):
    """Same logits as a plain cache fed explicit position_ids T.., unlike positions t.."""
    model, _ = model_tok
    prefix = setup["made"]["fold"]
    new = setup["new"]
    ours = serve.to_cache(model, prefix)
    logits = {}
    for name, start in (("T", T), ("t", prefix.kept)):
        plain = DynamicCache(config=model.config)
        for i in range(prefix.model.num_layers):
            k, v, _ = prefix.serving_layer(i)
            plain.update(k[None], v[None], i)
        pos = torch.arange(start, start + new.shape[1])[None]
        with torch.inference_mode():
            logits[name] = model(input_ids=new, position_ids=pos, cache=plain).logits
    with torch.inference_mode():
        got = model(input_ids=new, cache=ours).logits
    assert ours.get_seq_length() == T + new.shape[1]
    assert ours.physical_length() == prefix.kept + new.shape[1]
    assert torch.allclose(got, logits["T"], atol=1e-5, rtol=0)
    assert not torch.allclose(got, logits["t"], atol=1e-2, rtol=0)


def test_folded_file_gives_exactly_the_in_memory_tokens(model_tok, setup, tmp_path):
    model, _ = model_tok
    prefix = setup["made"]["fold"]
    loaded = cachefile.load(cachefile.save(tmp_path / "f.safetensors", prefix), model)
    for a, b in zip(prefix.keys + prefix.values, loaded.keys + loaded.values):
        assert torch.equal(a, b)
    disk = _greedy(model, serve.to_cache(model, loaded), setup["new"])
    assert torch.equal(disk, setup["fold_tokens"])


def _errors(prefix, cap, layer, head, q):
    k, v, bias = prefix.serving_layer(layer)
    full, _ = exact_attention(q, cap.keys[layer][head].float(), cap.values[layer][head].float(),
                              scale=cap.scales[layer])
    b = None if bias is None else bias[head]
    out, _ = exact_attention(q, k[head], v[head], scale=cap.scales[layer], bias=b)
    return float((out - full).norm(dim=-1).mean() / full.norm(dim=-1).mean())


def test_fold_error_close_to_am_on_heldout_queries(setup):
    cap, made = setup["cap"], setup["made"]
    ratios, fold_err, drop_err = [], [], []
    for layer in range(len(cap.keys)):
        for head in range(cap.keys[layer].shape[0]):
            q = cap.by_pass["heldout"][layer][head]  # [n, D], never seen by the compaction
            am = _errors(made["am"], cap, layer, head, q)
            fold_err.append(_errors(made["fold"], cap, layer, head, q))
            drop_err.append(_errors(made["drop"], cap, layer, head, q))
            ratios.append(fold_err[-1] / am)
    ratios.sort()
    median = ratios[len(ratios) // 2]
    assert median < 1.05, f"median fold/AM error ratio {median:.3f}"  # measured 1.009
    assert sum(fold_err) < sum(drop_err)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("case", sorted(hostile_files.CASES))
def test_hostile_files_are_refused_on_load(model_tok, setup, tmp_path, case):
    """Every way a file can be wrong (tests/hostile_files.py) is refused with its reason, for the
    model the file was made for; a header declaring huge tensors is refused before any is read."""
    model, _ = model_tok
    src = cachefile.save(tmp_path / "ok.safetensors", setup["made"]["fold"])
    make, fragment = hostile_files.CASES[case]
    bad = tmp_path / "bad.safetensors"
    make(src, bad)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        cachefile.load(bad, model)
    if case not in ("tampered_data", "tampered_metadata", "nan", "inf", "indices_unordered",
                    "indices_out_of_range"):  # these need the data: refused by load, not by the header
        with pytest.raises(ValueError, match=re.escape(fragment)):
            cachefile.inspect(bad, lambda info: check_model(info, model, where=str(bad)))
    assert cachefile.load(src, model).kept == setup["made"]["fold"].kept  # the source itself loads


def test_files_for_another_model_are_refused(model_tok, setup, tmp_path):
    model, _ = model_tok
    path = cachefile.save(tmp_path / "c.safetensors", setup["made"]["fold"])
    with pytest.raises(ValueError, match="num_layers=30"):
        cachefile.load(path, _tiny_llama())
    w = model.get_decoder().layers[0].self_attn.k_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(1.01)
    try:
        with pytest.raises(ValueError, match="weights hash"):
            cachefile.load(path, model)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_locks_runs_on_a_folded_cache(model_tok, setup):
    model, _ = model_tok
    prefix, new = setup["made"]["fold"], setup["new"]
    wide = serve.to_locks_cache(model, prefix, method="locks", config=LocksConfig(budget=1024))
    assert torch.equal(_greedy(model, wide, new), setup["fold_tokens"])  # budget >= all pages: exact
    narrow = serve.to_locks_cache(model, prefix, method="locks", config=LocksConfig(budget=32))
    out = _greedy(model, narrow, new, n=8)
    stats = narrow.stats.summary()
    assert out.shape[1] == 8 and stats["decode_steps"] > 0
    assert stats["tokens_attended"] < stats["context_tokens"]
    with pytest.raises(ValueError, match="logit bias"):
        serve.to_locks_cache(model, setup["made"]["am"])


def test_layers_fitted_together_equal_layers_fitted_alone(setup):
    """The GPU path stacks several layers' KV heads into one batched fit (layer_chunks): every
    layer's result is what fitting it alone gives (same kept positions, keys and values to float
    rounding), here on the CPU with three layers stacked."""
    from kvlocks.integrations.hf.compaction.model import fit_chunk, layer_chunks

    cap, cfg = setup["ref_cap"], CompactionConfig(method="fold", ratio=0.1, max_queries=512)
    t = cfg.budget(cap.prefix_len)
    assert layer_chunks(cap, t, cfg, "cpu") == [[i] for i in range(len(cap.keys))]  # the CPU: one at a time
    together = fit_chunk(cap, [3, 4, 5], t, cfg, "cpu")
    for layer, (k, v, b, idx) in zip((3, 4, 5), together):
        alone = fit_chunk(cap, [layer], t, cfg, "cpu")[0]
        assert torch.equal(idx, alone[3]) and b is None and alone[2] is None
        torch.testing.assert_close(k, alone[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, alone[1], rtol=1e-4, atol=1e-5)
    made = setup["made"]["fold"]  # and the same as the compaction the fixture made layer by layer
    assert torch.equal(together[0][3], made.indices[3])


def test_bias_attention_matches_explicit_softmax():
    """The am/rank1 serving path: beta as an additive SDPA mask, causal for appended tokens."""
    torch.manual_seed(0)
    b, hq, hkv, length, t, d = 1, 6, 2, 3, 5, 8
    n = t + length
    q, k, v = torch.randn(b, hq, length, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    bias = torch.rand(1, hkv, t) * 6 - 3

    class Layer:
        bias_consumed = False

    layer = Layer()
    layer.bias = bias
    k._kvlocks_bias_layer = layer
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.layer_idx = hq // hkv, True, 0
    out, _ = compact_attn.compact_attention(module, q, k, v, None, scaling=d ** -0.5)
    assert layer.bias_consumed
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    logits = q @ kk.transpose(-1, -2) * d ** -0.5  # [B, Hq, L, N]
    logits[..., :t] += bias.repeat_interleave(hq // hkv, 1)[:, :, None, :]
    future = torch.arange(length)[:, None] + t < torch.arange(n)[None, :]
    ref = torch.softmax(logits.masked_fill(future, -math.inf), -1) @ vv  # [B, Hq, L, D]
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)


def test_recorder_keeps_the_same_rows_however_a_pass_is_chunked():
    from kvlocks.integrations.hf.compaction.capture import QueryRecorder

    q = torch.randn(1, 6, 50, 4)  # [1, Hq, L, D], Hkv = 2
    kept = []
    for cuts in ([50], [7, 30, 13], [1] * 50):
        rec = QueryRecorder(6, 2, cap=40, seed=3)
        rec.start_pass(50)
        start = 0
        for n in cuts:
            rec.add(0, q[:, :, start:start + n], None)
            start += n
        rec.finish_pass("p")
        kept.append(rec.passes["p"][0])
    assert kept[0].shape == (2, 40, 4) and rec.counts["p"] == 150
    assert torch.equal(kept[0], kept[1]) and torch.equal(kept[0], kept[2])
    # row r of KV head h is query head 3h + r % 3 at token r // 3
    full = q[0].reshape(2, 3, 50, 4).transpose(1, 2).reshape(2, 150, 4)
    assert all(any(torch.equal(row, x) for x in full[0]) for row in kept[0][0])


def test_cli_compact_then_generate_from_the_cache(tmp_path):
    from kvlocks.cli import main

    text = tmp_path / "doc.txt"
    text.write_text("".join(natural_units()[:20]))
    out = tmp_path / "cache.safetensors"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["compact", "--input", str(text), "--ratio", "0.1", "--method", "fold",
                   "--out", str(out), "--max-tokens", "128", "--max-queries", "256",
                   "--self-study-tokens", "0", "--json"])
    assert rc == 0, buf.getvalue()
    report = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert (report["T"], report["t"], report["method"]) == (128, 13, "fold")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["generate", "--cache", str(out), "--prompt", "What is it about?", "--raw",
                   "--method", "locks", "--budget", "32", "--max-new-tokens", "6", "--json"])
    assert rc == 0, buf.getvalue()
    result = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert result["prefix"]["T"] == 128 and result["prefix"]["compaction"] == "fold"
    assert result["text"].strip()


def test_importing_the_compaction_modules_registers_nothing():
    code = (
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "before = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping))\n"
        "import kvlocks.integrations.hf.compaction.attention, kvlocks.integrations.hf.compaction.capture, kvlocks.integrations.hf.compaction.model\n"
        "import kvlocks.compaction.cachefile, kvlocks.integrations.hf.compaction.serve, kvlocks.integrations.hf.compaction.passes\n"
        "import kvlocks.commands.compact\n"
        "after = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping))\n"
        "assert before == after and 'kvlocks_compact' not in AttentionInterface._global_mapping\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
