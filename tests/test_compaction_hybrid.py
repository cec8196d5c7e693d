"""Compaction of a hybrid model (tiny random Gemma 3, fp32, CPU): global layers compacted, sliding
layers kept exactly.

References: transformers' own ``DynamicCache`` and attention over the whole prefix (ratio 1.0: every
method's exact solution is the prefix itself), and a stock ``DynamicCache`` seeded with the
compacted tensors and fed explicit positions T.. (ratio < 1: what the served cache must compute).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from kvlocks.compaction import CompactionConfig, cachefile
from kvlocks.integrations.hf.compaction import serve
from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.integrations.hf.compaction.model import compact_capture
from kvlocks.integrations.hf.compaction.passes import QueryPass
from kvlocks.config import LocksConfig
from kvlocks.integrations.hf import cache_kwargs
from kvlocks.hybrid import layer_windows

from test_gemma import GLOBAL, TYPES, W, ids_of, tiny_gemma

T = 80  # > W: the sliding layers drop most of the prefix
NEW = ids_of(6, seed=7)


def _capture(model, prefix):
    passes = [QueryPass("repeat", prefix[:, :40]), QueryPass("answer", ids_of(5, seed=3), generate=4)]
    return capture_queries(model, prefix, passes, max_queries=256, seed=0)


@pytest.fixture(scope="module")
def made():
    model = tiny_gemma()
    prefix = ids_of(T)
    cap = _capture(model, prefix)
    return model, prefix, cap, {m: compact_capture(model, cap, CompactionConfig(method=m, ratio=0.25, max_queries=256))
                                for m in ("fold", "am")}


def _logits(model, cache, new, **kw):
    with torch.inference_mode():
        return model(input_ids=new, use_cache=True, **kw, **cache_kwargs(model, cache)).logits[0].float()


def _stock_prefill(model, prefix):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=prefix, use_cache=True, **cache_kwargs(model, cache))
    return cache


def _close(a, b, rel=1e-4):
    return torch.allclose(a, b, rtol=rel, atol=rel * float(b.abs().max()))


@pytest.mark.parametrize("method", ["fold", "am", "rank1"])
def test_ratio_one_serves_exactly_what_the_uncompacted_model_computes(made, method):
    model, prefix, cap, _ = made
    whole = compact_capture(model, cap, CompactionConfig(method=method, ratio=1.0))
    want = _logits(model, _stock_prefill(model, prefix), NEW)
    assert _close(_logits(model, serve.to_cache(model, whole), NEW), want)
    if method == "fold":  # LOCKS over the compacted prefix: dense, and a budget covering the context
        assert _close(_logits(model, serve.to_locks_cache(model, whole, method="full"), NEW), want)
        cfg = LocksConfig(budget=512, page_size=16, rank=4)
        assert _close(_logits(model, serve.to_locks_cache(model, whole, method="locks", config=cfg), NEW), want)


def test_sliding_layers_keep_their_window_exactly_and_global_layers_are_compacted(made):
    model, prefix, _, by_method = made
    fold = by_method["fold"]
    stock = _stock_prefill(model, prefix)
    assert fold.windows == layer_windows(model.config) and fold.kept == T // 4
    for i, kind in enumerate(TYPES):
        keys, idx = fold.keys[i], fold.indices[i]
        if kind == "sliding_attention":  # the stock sliding cache after T tokens: its last W - 1
            assert keys.shape[1] == W - 1 and torch.equal(idx[0], torch.arange(T - W + 1, T))
            assert torch.allclose(keys, stock.layers[i].keys[0], atol=1e-5)
            assert torch.allclose(fold.values[i], stock.layers[i].values[0], atol=1e-5)
        else:
            assert i in GLOBAL and keys.shape[1] == T // 4


def test_new_tokens_continue_at_position_T_with_exact_windows(made):
    """The served cache against a stock cache holding the same tensors fed positions T.. explicitly
    (transformers' own masks: the sliding layers' W - 1 entries and the global layers' t); positions
    t.. give other logits."""
    model, _, _, by_method = made
    prefix = by_method["fold"]
    ours = _logits(model, serve.to_cache(model, prefix), NEW)
    got = {}
    for start in (T, prefix.kept):
        plain = DynamicCache(config=model.config)
        for i in range(len(TYPES)):
            k, v, _ = prefix.serving_layer(i)
            plain.update(k[None], v[None], i)
        got[start] = _logits(model, plain, NEW, position_ids=torch.arange(start, start + NEW.shape[1])[None])
    assert _close(ours, got[T])
    assert not _close(ours, got[prefix.kept], rel=1e-2)
    cache = serve.to_cache(model, prefix)
    _logits(model, cache, NEW)
    assert cache.get_seq_length() == T + NEW.shape[1] and cache.physical_length() == prefix.kept + NEW.shape[1]


def test_file_round_trip_keeps_the_windows_and_the_logits(made, tmp_path):
    model, _, _, by_method = made
    path = cachefile.save(tmp_path / "h.safetensors", by_method["fold"])
    loaded = cachefile.load(path, model)
    assert loaded.windows == by_method["fold"].windows
    want = _logits(model, serve.to_cache(model, by_method["fold"]), NEW)
    assert torch.equal(_logits(model, serve.open_cache(model, path), NEW), want)
    other = tiny_gemma()  # same weights, another layer pattern
    other.config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"] * 2
    with pytest.raises(ValueError, match="sliding-window layers .* are not this model's"):
        cachefile.load(path, other)


def _rewrite(src, dst, edit):
    """Copy a cache file with ``edit(meta, tensors)`` applied and its checksum recomputed (a forger's file)."""
    with safe_open(str(src), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    meta["checksum"] = cachefile.checksum(meta, tensors)
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.mark.parametrize("case,match", [
    ("not_json", "layer_windows=.*must be a JSON list of 6 entries"),
    ("short", "layer_windows=.*must be a JSON list of 6 entries"),
    ("all_global", r"tensor layers\.0\.keys has shape \(1, 31, 256\) F32; expected \(1, 20, 256\)"),
    ("not_last", "layers.0 is a sliding-window layer; its indices must be the prefix's last 31 positions"),
])
def test_forged_window_metadata_is_refused(made, tmp_path, case, match):
    _, _, _, by_method = made
    path = cachefile.save(tmp_path / "h.safetensors", by_method["fold"])

    def edit(meta, tensors):
        if case == "not_json":
            meta["layer_windows"] = "[32, 32"
        elif case == "short":
            meta["layer_windows"] = json.dumps([W, W, None])
        elif case == "all_global":
            meta["layer_windows"] = json.dumps([None] * len(TYPES))
        else:
            tensors["layers.0.indices"] = torch.arange(W - 1)[None].clone()

    with pytest.raises(ValueError, match=match):
        cachefile.load(_rewrite(path, tmp_path / "forged.safetensors", edit))
