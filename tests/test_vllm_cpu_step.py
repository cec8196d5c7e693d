"""The vLLM CPU backend's decode step (:func:`kvlocks.integrations.vllm.cpu.store.decode_rows`) over
caches in vLLM's CPU layouts (built here from random keys, element offsets as
``tests/test_vllm_amx_layout.py`` and ``kvlocks.integrations.vllm.compat`` describe them) selects
the pages of ``DecodePlan(backend="torch")`` on the same keys in the plan's own paged layout, with
summaries built independently, and gives its output, in every selection mode the plan runs. No
vLLM needed (the real cache-write op is exercised in ``tests/vllm``)."""

import math

import pytest
import torch

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.compat import split_kv_cache
from kvlocks.integrations.vllm.cpu.store import BlockSummaryStore, PagedBlocks, decode_rows
from kvlocks.integrations.vllm.sinks import apply_sinks
from kvlocks.pages import full_pages
from kvlocks.plan import DecodePlan, paged_build
from kvlocks.summary.store import SummaryStore

S, HKV, G, D, BS, NB = 16, 2, 3, 32, 64, 48
MODES = {
    "flat": {"rerank": 0},
    "rerank": {"rerank": 4},
    "centroid": {"rerank": 16, "rerank_min": 40, "rerank_scores": "centroid"},
}
LAYOUTS = [("kT_v", torch.float32), ("k_v", torch.float32), ("amx", torch.bfloat16)]


def vllm_cache(keys, values, layout):
    """``keys, values [NB, Hkv, BS, D]`` token-major -> vLLM's ``[NB, Hkv, BS, 2D]`` CPU cache."""
    nb, h, bs, d = keys.shape
    if layout == "amx":  # both halves packed in pairs (compat's module doc)
        r, j = torch.arange(bs).view(bs, 1), torch.arange(d).view(1, d)
        koff = (((r // 16) * (d // 2) + j // 2) * 32 + (r % 16) * 2 + j % 2).flatten()
        voff = (((j // 16) * (bs // 2) + r // 2) * 32 + (j % 16) * 2 + r % 2).flatten()
        kv = torch.zeros(nb, h, 2, bs * d, dtype=keys.dtype)
        kv[:, :, 0, koff] = keys.reshape(nb, h, bs * d)
        kv[:, :, 1, voff] = values.reshape(nb, h, bs * d)
        return kv.view(nb, h, bs, 2 * d)
    k = keys.transpose(-1, -2) if layout == "kT_v" else keys  # keys dimension-major [D, BS] or token-major
    return torch.cat([k.reshape(nb, h, bs * d), values.reshape(nb, h, bs * d)], dim=-1).view(nb, h, bs, 2 * d)


def case(dtype, seed=0):
    """Three decode rows (one sharing its first two blocks with another, as prefix caching does)
    over scrambled blocks: keys/values ``[NB, Hkv, BS, D]``, queries, vLLM block table, lengths."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(NB, HKV, BS, D, generator=gen)
    keys += 2 * torch.randn(NB, HKV, 1, D, generator=gen)  # a direction per block: pages differ in mass
    values = torch.randn(NB, HKV, BS, D, generator=gen)
    lens = torch.tensor([1000, 437, 1280])
    perm = torch.randperm(NB, generator=gen)
    table = torch.zeros(3, 20, dtype=torch.int64)
    table[0, :16], table[1, :7], table[2, :20] = perm[:16], perm[16:23], perm[23:43]
    table[1, :2] = table[0, :2]  # shared prefix blocks
    q = torch.randn(3, HKV * G, D, generator=gen)
    return keys.to(dtype), values.to(dtype), q, table, lens


def plan_layout(x):
    """``[NB, Hkv, BS, D]`` -> the plan's ``[NB * BS / S, S, Hkv, D]`` (physical page b * BS / S + j)."""
    return x.view(NB, HKV, BS // S, S, D).permute(0, 2, 3, 1, 4).reshape(NB * BS // S, S, HKV, D)


def reference(cfg, keys, values, q, table, lens):
    """``DecodePlan(backend="torch")`` on the plan's layout, summaries built by ``paged_build``."""
    kp, vp = plan_layout(keys.float()), plan_layout(values.float())
    store = BlockSummaryStore(cfg, NB, BS, HKV, D)
    pt = store.page_table(table, 80)
    summaries = SummaryStore.empty(kp.shape[0], HKV, D, cfg)
    full = torch.cat([pt[i, : int(full_pages(lens[i], S))] for i in range(3)]).unique()
    paged_build(kp, summaries, full, cfg, backend="torch")
    plan = DecodePlan(batch=3, num_kv_heads=HKV, group=G, head_dim=D, max_pages=pt.shape[1], config=cfg,
                      dtype=torch.float32, device="cpu", backend="torch")
    out, lse = plan.run(q, kp, vp, summaries, pt, lens)
    return out, lse, plan.pages


def backend_step(cfg, keys, values, q, table, lens, layout, **kw):
    store = BlockSummaryStore(cfg, NB, BS, HKV, D)
    kc, vc = split_kv_cache(vllm_cache(keys, values, layout), HKV, D, layout)
    kv = PagedBlocks(kc, S), PagedBlocks(vc, S)
    return store, kv, decode_rows(store, *kv, q, table, lens, scale=1 / math.sqrt(D), **kw)


@pytest.mark.parametrize("layout,dtype", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_backend_step_is_the_torch_plan(mode, layout, dtype):
    cfg = LocksConfig(budget=128, **MODES[mode])
    keys, values, q, table, lens = case(dtype)
    ref_out, _, ref_pages = reference(cfg, keys, values, q, table, lens)
    _, _, (out, pages, built, stale) = backend_step(cfg, keys, values, q, table, lens, layout)
    assert pages.shape == (3, HKV, 8) and bool((pages >= 0).all())
    assert torch.equal(pages, ref_pages)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert built == [62, 27 - 8, 80] and stale is None  # row 1's first 8 pages (2 shared blocks) are built


@pytest.mark.parametrize("mode", ["flat", "centroid"])
def test_torch_backend_of_the_step_is_the_reference(mode):
    cfg = LocksConfig(budget=128, **MODES[mode])
    keys, values, q, table, lens = case(torch.float32, seed=3)
    ref_out, _, ref_pages = reference(cfg, keys, values, q, table, lens)
    _, _, (out, pages, _, _) = backend_step(cfg, keys, values, q, table, lens, "kT_v", backend="torch")
    assert torch.equal(pages, ref_pages)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)


def test_sinks_and_verification():
    cfg = LocksConfig(budget=128, rerank=4)
    keys, values, q, table, lens = case(torch.float32, seed=1)
    sinks = torch.randn(HKV * G) + 1
    ref_out, ref_lse, _ = reference(cfg, keys, values, q, table, lens)
    store, kv, (out, _, built, stale) = backend_step(cfg, keys, values, q, table, lens, "kT_v", sinks=sinks,
                                                     verify=False)
    torch.testing.assert_close(out, apply_sinks(ref_out.clone(), ref_lse, sinks), rtol=1e-5, atol=1e-5)
    store.enable_verification()
    store.built_gen.fill_(-1)  # rebuild all, remembering the keys
    _, _, built, stale = decode_rows(store, *kv, q, table, lens, scale=1 / math.sqrt(D), verify=True)
    assert sum(built) == 62 + 19 + 80 and stale == [0, 0, 0]
    _, _, built, stale = decode_rows(store, *kv, q, table, lens, scale=1 / math.sqrt(D), verify=True)
    assert built == [0, 0, 0] and stale == [0, 0, 0]  # valid summaries are reused
    kv[0].tokens[int(table[2, 5]), :, 3] += 1.0  # keys of row 2's page 20 change behind the tags' back
    store.ignore_tags = True
    assert decode_rows(store, *kv, q, table, lens, scale=1 / math.sqrt(D), verify=True)[3] == [0, 0, 1]
    store.ignore_tags = False
    store.note_writes(torch.tensor([int(table[2, 5]) * BS + 3]))  # the write seen: rebuilt, fresh
    _, _, built, stale = decode_rows(store, *kv, q, table, lens, scale=1 / math.sqrt(D), verify=True)
    assert built == [0, 0, 1] and stale == [0, 0, 0]


def test_paged_blocks_read_the_plan_layout():
    keys, values, *_ = case(torch.bfloat16, seed=2)
    for layout, _ in LAYOUTS:
        kc, vc = split_kv_cache(vllm_cache(keys, values, layout), HKV, D, layout)
        for half, want in ((PagedBlocks(kc, S), plan_layout(keys)), (PagedBlocks(vc, S), plan_layout(values))):
            assert half.shape == want.shape
            ids = torch.tensor([0, 5, 191, 17, 17])
            assert torch.equal(half.index_select(0, ids), want.index_select(0, ids))
            pages, heads = torch.tensor([[[3], [100]], [[7], [7]]]), torch.arange(HKV).view(1, HKV, 1)
            assert torch.equal(half[pages, :, heads], want[pages, :, heads])
            with pytest.raises(IndexError, match="x\\[pages, :, heads\\]"):
                half[pages]
