"""The Hugging Face path on the bundled model (fp32, CPU)."""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():  # the Triton-backend tests below run in the interpreter; set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports triton (tests/test_kernels.py does too)

from kvlocks import LocksConfig, build_summaries
from kvlocks.integrations.hf.decode import prefill, step
from kvlocks.integrations.hf import LocksCache, cache_kwargs

pytestmark = pytest.mark.model

PROMPT = (
    "Alice keeps her bicycle in the red shed behind the library. Bob keeps his canoe in the "
    "boathouse by the river. Carol keeps her telescope on the roof of the observatory. "
    "Where does Alice keep her bicycle?"
)


@pytest.fixture(scope="module")
def model_tok():
    from kvlocks.models import load

    return load("smollm2-135m")


def _ids(tok, text):
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(chat, return_tensors="pt", add_special_tokens=False).input_ids


def test_budget_above_context_gives_full_logits_every_step(model_tok):
    model, tok = model_tok
    ids = _ids(tok, PROMPT)
    big = LocksConfig(budget=4096)
    caches = {m: LocksCache(model.config, method=m, config=big) for m in ("full", "locks", "oracle")}
    logits = {m: [prefill(model, c, ids)] for m, c in caches.items()}
    token = int(torch.argmax(logits["full"][0]))
    for _ in range(20):  # crosses at least one page boundary (incremental builds)
        for m, c in caches.items():
            logits[m].append(step(model, c, token))
        token = int(torch.argmax(logits["full"][-1]))
    for m in ("locks", "oracle"):
        for a, b in zip(logits["full"], logits[m]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    assert caches["locks"].layers[0].store.build_calls >= 2  # prefill batch + at least one page filled


def test_greedy_generate_equals_full_at_large_budget(model_tok):
    model, tok = model_tok
    ids = _ids(tok, PROMPT)
    outs = {}
    for m in ("full", "locks"):
        cache = LocksCache(model.config, method=m, config=LocksConfig(budget=1024))
        outs[m] = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(outs["full"], outs["locks"])
    assert "shed" in tok.decode(outs["full"][0, ids.shape[1]:]).lower()


def test_incremental_summaries_equal_batch_build(model_tok):
    model, tok = model_tok
    ids = _ids(tok, PROMPT)
    cfg = LocksConfig(budget=64)
    cache = LocksCache(model.config, method="locks", config=cfg)
    model.generate(input_ids=ids, max_new_tokens=40, do_sample=False, **cache_kwargs(model, cache))
    store = cache.layers[3].store
    p = store.length // 16
    again = build_summaries(store.keys[:, :, : p * 16].unflatten(2, (p, 16)), cfg)
    assert store.summaries.num_pages == p
    assert torch.equal(store.summaries.coef, again.coef) and torch.equal(store.summaries.basis, again.basis)


def test_padded_batch_and_sampling(model_tok):
    model, tok = model_tok
    tok.padding_side = "left"
    texts = [PROMPT, "Name three colours of the rainbow."]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    assert bool((enc.attention_mask == 0).any())  # the batch really is padded
    outs = {}
    for m in ("full", "locks"):
        cache = LocksCache(model.config, method=m, config=LocksConfig(budget=2048))
        outs[m] = model.generate(**enc, max_new_tokens=12, do_sample=False, **cache_kwargs(model, cache))
    assert torch.equal(outs["full"], outs["locks"])
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=32))
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=40, do_sample=True, temperature=0.8, **cache_kwargs(model, cache))
    assert out.shape[0] == 2 and cache.stats.steps > 0
    s = cache.stats.summary()
    assert s["pages_selected"] <= 2 and s["read_fraction"] < 1


def test_small_budget_reads_fewer_bytes(model_tok):
    model, tok = model_tok
    ids = _ids(tok, PROMPT * 4)
    cache = LocksCache(model.config, method="locks", config=LocksConfig(budget=64))
    model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **cache_kwargs(model, cache))
    s = cache.stats.summary()
    assert s["pages_selected"] == 4 and s["tokens_attended"] <= 64
    payload, scales = cache.layers[0].store.summaries.bytes_per_page()
    n_full = (ids.shape[1] + 1) // 16  # context at the first decode step
    assert s["selection_bytes"] >= 3 * n_full * (payload + scales)
    assert s["bytes_read"] < s["full_bytes"]


def test_unknown_method_is_rejected(model_tok):
    model, _ = model_tok
    with pytest.raises(ValueError, match="method="):
        LocksCache(model.config, method="fast")


def test_import_changes_nothing_in_torch_or_transformers():
    code = (
        "import torch, torch.nn.functional as F, transformers\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "before = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping),"
        " F.scaled_dot_product_attention, torch.Tensor.__getattribute__, dict(vars(F)))\n"
        "import kvlocks, kvlocks.integrations.hf, kvlocks.models, kvlocks.cli\n"
        "after = (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping),"
        " F.scaled_dot_product_attention, torch.Tensor.__getattribute__, dict(vars(F)))\n"
        "assert before == after, 'importing kvlocks changed torch or transformers'\n"
        "assert 'kvlocks' not in AttentionInterface._global_mapping\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the Triton kernel path: forced on the CPU through the interpreter ----

def _tiny_llama(seed=0, layers=1):
    """A small random Llama with the kernels' shapes (D = 64, G = 2), fp32, kvlocks attention.
    (One layer: the Triton interpreter runs the summary build at ~0.7 s per program.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlocks.integrations.hf import enable

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval().to("cuda" if torch.cuda.is_available() else "cpu")
    enable(model)
    return model


def _decode_logits(model, cache, ids, steps):
    logits = [prefill(model, cache, ids)]
    token = int(torch.argmax(logits[0]))
    for _ in range(steps):
        logits.append(step(model, cache, token))
        token = int(torch.argmax(logits[-1]))
    return torch.stack([x.float() for x in logits])


@pytest.fixture(scope="module")
def interpreter():
    pytest.importorskip("triton")


def test_triton_backend_matches_reference_path(interpreter, monkeypatch):
    import kvlocks.integrations.hf.cache as hf

    calls = []
    plan_decode = hf.plan_decode
    monkeypatch.setattr(hf, "plan_decode", lambda *a: calls.append(a[-1]) or plan_decode(*a))
    model = _tiny_llama()
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1)).to(model.device)
    cfg = LocksConfig(budget=48)  # 3 of 6 pages: sink, recent and one by score
    ref = LocksCache(model.config, method="locks", config=cfg, backend="torch")
    tri = LocksCache(model.config, method="locks", config=cfg, backend="triton")
    keys = torch.zeros(1, 2, 16, 64, device=model.device)
    assert tri.uses_kernels(keys) and not ref.uses_kernels(keys)
    a = _decode_logits(model, ref, ids, 8)  # 90 -> 98 tokens: page 6 fills at step 6
    b = _decode_logits(model, tri, ids, 8)
    assert calls == ["triton"] * 8  # one layer, eight decode steps, all on the plan's kernels
    assert tri.layers[0].store.build_calls == 2 and tri.layers[0].store.summaries.num_pages == 98 // 16
    assert torch.allclose(a, b, atol=2e-4 * float(a.abs().max()), rtol=1e-4)
    assert tri.stats.summary()["pages_selected"] == ref.stats.summary()["pages_selected"] == 3


def test_triton_backend_budget_above_context_equals_full(interpreter):
    model = _tiny_llama(seed=2)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3)).to(model.device)
    full = _decode_logits(model, LocksCache(model.config, method="full"), ids, 3)
    tri = _decode_logits(model, LocksCache(model.config, method="locks", config=LocksConfig(budget=1024),
                                           backend="triton"), ids, 3)
    assert torch.allclose(full, tri, atol=1e-4 * float(full.abs().max()), rtol=1e-4)


def test_kernel_path_only_for_the_kernels_config():
    from kvlocks.integrations.hf import kernel_path
    from kvlocks.selection.selectors import get_selector

    locks = get_selector("locks")
    assert kernel_path(locks, LocksConfig(), 64) and kernel_path(locks, LocksConfig(), 128)
    assert not kernel_path(locks, LocksConfig(basis_bits=8), 64)
    assert not kernel_path(locks, LocksConfig(), 96)
    assert kernel_path(get_selector("oracle"), LocksConfig(), 64)  # its own scores; the kernels select, attend
    assert not kernel_path(locks, LocksConfig(page_size=32, budget=64), 64)  # the references run instead
    assert not kernel_path(locks, LocksConfig(rank=6), 64)
    with pytest.raises(ValueError, match="backend="):
        LocksCache(_tiny_llama().config, method="locks", backend="cuda")
