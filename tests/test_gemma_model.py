"""Gemma 3 270M, the second bundled model (a hybrid base model), on the Hugging Face path and in
the task suite (fp32, CPU). The reference is transformers' own model with its own cache."""

import json

import pytest
import torch

from kvlocks import LocksConfig
from kvlocks.integrations.hf import LocksCache, enable
from kvlocks.integrations.hf.decode import prefill, step

pytestmark = pytest.mark.model

WINDOW, GLOBAL = 512, [5, 11, 17]


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("gemma3-270m")


def test_converted_model_is_the_hybrid_base_model(model_tok):
    model, tok = model_tok
    c = model.config
    assert c.model_type == "gemma3_text" and c.num_hidden_layers == 18
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 1, 256)
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == GLOBAL
    assert c.sliding_window == WINDOW and c.max_position_embeddings == 32768
    rope = c.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] == 1e4 and rope["full_attention"]["rope_theta"] == 1e6
    assert not tok.chat_template  # a base model: plain-text prompts
    assert tok("a").input_ids[0] == tok.bos_token_id == 2


def test_tokenizer_reads_text_as_the_model_was_trained(model_tok):
    """<bos> first, digits one by one, a decode that gives the text back (a converter that drops
    <bos> or breaks merges fails this and ``check_tokenizer``)."""
    from kvlocks.models.bundled import CANARY_TEXT, check_tokenizer

    _, tok = model_tok
    check_tokenizer("gemma3-270m", tok)
    ids = tok(CANARY_TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:]) == CANARY_TEXT and [tok.decode([i]) for i in ids[6:11]] == list("77696")


def _text_ids(tok, n):
    from kvlocks.corpus import natural_units

    text = "".join(natural_units()[:200])
    ids = tok(text, return_tensors="pt").input_ids  # starts with BOS
    assert ids.shape[1] >= n
    return ids[:, :n]


def test_budget_above_context_reproduces_transformers(model_tok):
    """600 prompt tokens (beyond the 512-token window) + 6 teacher-forced steps: full, locks and
    oracle at a budget above the context give transformers' own logits (fp32, 1e-4 relative)."""
    from transformers.cache_utils import DynamicCache

    model, tok = model_tok
    ids = _text_ids(tok, 606)
    ctx, feed = ids[:, :600], ids[0, 600:].tolist()
    model.set_attn_implementation("sdpa")
    try:
        ref_cache = DynamicCache(config=model.config)
        ref = [prefill(model, ref_cache, ctx).float()] + [step(model, ref_cache, t) for t in feed]
    finally:
        enable(model)
    base = LocksCache(model.config, method="locks", config=LocksConfig(budget=1024))
    first = prefill(model, base, ctx).float()
    assert torch.allclose(first, ref[0], rtol=1e-4, atol=1e-4 * float(ref[0].abs().max()))
    for method in ("full", "locks", "oracle"):
        cache = base.fork(method=method)
        for a, t in zip(ref[1:], feed):
            b = step(model, cache, t)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max())), method
        s = cache.stats.summary()
        assert s["layers"] == {"window": 15, ("dense" if method == "full" else "sparse"): 3}
        assert s["by_kind"]["window"]["tokens_attended"] == WINDOW
    assert [i for i, layer in enumerate(base.layers) if getattr(getattr(layer, "store", None), "summaries", None)
            is not None] == GLOBAL


def test_passkey_2k_cell_with_full_locks_and_oracle(model_tok, tmp_path):
    """One 2K passkey record through ``kvlocks eval``'s runner: a plain-text prompt (a base model),
    one shared prefill, full, locks and oracle decoded; the hybrid accounting in every row."""
    from kvlocks_lab.eval.suite import EvalConfig, run_eval
    from kvlocks_lab.eval.tasks import generate

    model, tok = model_tok
    record = generate("passkey", tok, 2048, 1)[0]
    assert record.context_ids[0] == tok.bos_token_id and "<start_of_turn>" not in record.context_text
    assert "A pass key is hidden" not in record.context_text  # a base model gets no instruction preamble
    assert record.suffix_text.endswith("\n\nThe pass key is")
    cfg = EvalConfig(model="gemma3-270m", tasks=("passkey",), lengths=(2048,), budgets=(256,),
                     methods=("full", "locks", "oracle"), samples=1)
    run_eval(cfg, tmp_path, model=model, tok=tok, progress=False)
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert sorted(rows) == ["full", "locks", "oracle"]
    assert rows["full"]["score"] == 1, rows["full"]["prediction"]  # the base model finds the key
    assert rows["full"]["stats_layers"] == {"window": 15, "dense": 3}
    for m in ("locks", "oracle"):
        assert rows[m]["stats_layers"] == {"window": 15, "sparse": 3}
        assert rows[m]["stats_by_kind"]["sparse"]["tokens_attended"] == pytest.approx(256, abs=16)
        assert rows[m]["stats_read_fraction"] < rows["full"]["stats_read_fraction"] == 1


def test_compacted_prefix_keeps_a_planted_key(model_tok, tmp_path):
    """Fold at ratio 0.25 with the question (the 3 global layers compacted, the sliding layers'
    last 511 tokens kept): the compacted file answers the planted key as the original context does.
    A base model's question pass is the question exactly as `kvlocks generate --prompt` feeds it
    (wrapped in blank lines it continued on a new line, and every ratio lost the key)."""
    from kvlocks.compaction import CompactionConfig, cachefile
    from kvlocks.integrations.hf.compaction import serve
    from kvlocks.integrations.hf.compaction.model import compact_prefix
    from kvlocks.integrations.hf.compaction.passes import ReferenceConfig

    model, tok = model_tok
    ids = _text_ids(tok, 700)
    fact = tok(" The pass key is 58213. Remember it.", return_tensors="pt", add_special_tokens=False).input_ids
    prefix_ids = torch.cat([ids[:, :300], fact, ids[:, 300:]], dim=1)  # the key ~400 tokens before the end
    question = " What is the pass key? The pass key is"
    reference = ReferenceConfig(self_study_tokens=8, questions=(question,))  # kvlocks compact --question
    prefix = compact_prefix(model, tok, prefix_ids, CompactionConfig(method="fold", ratio=0.25), reference=reference)
    assert prefix.windows[5] is None and prefix.windows[0] == WINDOW and prefix.keys[0].shape[1] == WINDOW - 1
    assert prefix.kept == prefix_ids.shape[1] // 4
    q = tok(question, return_tensors="pt", add_special_tokens=False).input_ids
    cache = serve.open_cache(model, cachefile.save(tmp_path / "g.safetensors", prefix))
    got = tok.decode(serve.generate(model, cache, q, max_new_tokens=8, do_sample=False)[0])
    with torch.inference_mode():
        full = model.generate(torch.cat([prefix_ids, q], 1), max_new_tokens=8, do_sample=False)
    assert "58213" in tok.decode(full[0, prefix_ids.shape[1] + q.shape[1]:]) and "58213" in got
