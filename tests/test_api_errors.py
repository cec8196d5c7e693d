"""Bad input to the public functional API gives a ValueError naming what is wrong, never a silent
NaN, a raw torch error or a ZeroDivisionError; good input still gives the exact answer."""

import math

import pytest
import torch

import kvlocks
from kvlocks import LocksConfig, build_summaries, dense_decode, score_pages, select_pages, sparse_decode

HKV, G, D, S = 2, 3, 16, 16
N = 5 * S + 3  # five full pages and a partial one


@pytest.fixture
def qkv():
    return torch.randn(HKV, G, D), torch.randn(HKV, N, D), torch.randn(HKV, N, D)


@pytest.fixture
def summ(qkv):
    _, k, _ = qkv
    cfg = LocksConfig(budget=3 * S)
    return build_summaries(k[:, : 5 * S].unflatten(1, (5, S)), cfg), cfg


def _exact(q, k, v, tokens):
    """Hand-written softmax attention over the token positions ``tokens`` (a list per row)."""
    outs = []
    for h in range(q.shape[0]):
        kk, vv = k[h, tokens[h]], v[h, tokens[h]]
        w = torch.softmax(q[h] @ kk.T / math.sqrt(q.shape[-1]), dim=-1)
        outs.append(w @ vv)
    return torch.stack(outs)


def test_the_front_door_is_one_module():
    import kvlocks.api as api

    for name in api.__all__:
        assert getattr(kvlocks, name) is getattr(api, name)
    for name in ("build_summaries", "score_pages", "select_pages", "sparse_decode", "dense_decode"):
        fn = getattr(api, name)
        assert fn.__module__ == "kvlocks.api" and "Parameters" in fn.__doc__ and "[Hkv" in fn.__doc__


def test_good_input_still_gives_the_exact_answer(qkv, summ):
    q, k, v = qkv
    s, cfg = summ
    pages = select_pages(q, s, cfg)
    assert pages.shape == (HKV, 3) and pages.dtype == torch.int64
    assert (pages[:, 0] == 0).all() and (pages[:, -1] == 4).all()
    assert score_pages(q, s, cfg).shape == (HKV, G, 5)
    ids = torch.tensor([[0, 5], [2, 5]])  # page 5 is the partial one (3 tokens)
    out, lse = sparse_decode(q, k, v, ids, S)
    tokens = [[*range(0, S), *range(5 * S, N)], [*range(2 * S, 3 * S), *range(5 * S, N)]]
    torch.testing.assert_close(out, _exact(q, k, v, tokens), atol=1e-5, rtol=1e-5)
    out32, _ = sparse_decode(q, k, v, ids.to(torch.int32), S)  # int32 ids are fine
    torch.testing.assert_close(out32, out)
    dense, _ = dense_decode(q, k, v)
    torch.testing.assert_close(dense, _exact(q, k, v, [list(range(N))] * HKV), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["keys", "values", "queries"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sparse_and_dense_decode_refuse_nan_inf(qkv, where, bad):
    q, k, v = qkv
    t = {"queries": q, "keys": k, "values": v}[where]
    t[0, 1, 2] = bad
    with pytest.raises(ValueError, match=f"{where} contains 1 NaN/Inf"):
        sparse_decode(q, k, v, torch.tensor([[0, 1], [0, 1]]), S)
    with pytest.raises(ValueError, match=f"{where} contains 1 NaN/Inf"):
        dense_decode(q, k, v)


def test_sparse_decode_page_ids_and_page_size(qkv):
    q, k, v = qkv
    ids = torch.tensor([[0, 1], [0, 2]])
    with pytest.raises(ValueError, match="page_ids must be an integer tensor.*float32"):
        sparse_decode(q, k, v, ids.float(), S)
    with pytest.raises(ValueError, match="page_ids must be an integer tensor.*bool"):
        sparse_decode(q, k, v, ids.bool(), S)
    with pytest.raises(ValueError, match="page_ids must be a torch.Tensor"):
        sparse_decode(q, k, v, [[0, 1], [0, 2]], S)
    for bad in (0, -16, 1.5, True, None):
        with pytest.raises(ValueError, match="page_size="):
            sparse_decode(q, k, v, ids, bad)
    with pytest.raises(ValueError, match=r"page_ids must lie in \[0, 6\)"):
        sparse_decode(q, k, v, torch.tensor([[0, 6], [0, 1]]), S)
    with pytest.raises(ValueError, match="distinct"):
        sparse_decode(q, k, v, torch.tensor([[1, 1], [0, 1]]), S)
    with pytest.raises(ValueError, match="K \\(pages selected\\)=0"):
        sparse_decode(q, k, v, torch.zeros(HKV, 0, dtype=torch.long), S)
    with pytest.raises(ValueError, match="page_ids leading dims"):
        sparse_decode(q, k, v, torch.tensor([[0, 1]]), S)


def test_decode_shapes_masks_scale_and_empty(qkv):
    q, k, v = qkv
    ids = torch.tensor([[0, 1], [0, 2]])
    with pytest.raises(ValueError, match="head_dim mismatch"):
        sparse_decode(q[..., :8], k, v, ids, S)
    with pytest.raises(ValueError, match="keys/values shape mismatch"):
        dense_decode(q, k, v[:, :-1])
    with pytest.raises(ValueError, match="leading dims mismatch"):
        dense_decode(q[:1], k, v)
    with pytest.raises(ValueError, match="empty context"):
        dense_decode(q, k[:, :0], v[:, :0])
    with pytest.raises(ValueError, match="floating-point.*int64"):
        dense_decode(q, k.long(), v)
    with pytest.raises(ValueError, match=r"token_mask must be a bool tensor"):
        dense_decode(q, k, v, token_mask=torch.ones(HKV, N))
    with pytest.raises(ValueError, match=r"token_mask must have shape"):
        sparse_decode(q, k, v, ids, S, token_mask=torch.ones(HKV, N - 1, dtype=torch.bool))
    mask = torch.ones(HKV, N, dtype=torch.bool)
    mask[1, 2 * S : 3 * S] = False
    mask[1, :S] = False  # row 1 attends pages 0 and 2: every one of their tokens is masked
    with pytest.raises(ValueError, match="excludes every attended token"):
        sparse_decode(q, k, v, ids, S, token_mask=mask)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "0.1"):
        with pytest.raises(ValueError, match="scale="):
            dense_decode(q, k, v, scale=bad)


def test_decode_refuses_mixed_devices(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match="one device.*queries on meta"):
        dense_decode(q.to("meta"), k, v)


def test_build_summaries_bad_input(qkv):
    _, k, _ = qkv
    pages = k[:, : 5 * S].unflatten(1, (5, S)).clone()  # [Hkv, P, S, D]
    cfg = LocksConfig()
    with pytest.raises(ValueError, match="config must be a kvlocks.LocksConfig"):
        build_summaries(pages, {"rank": 8})
    with pytest.raises(ValueError, match="page_size=16"):
        build_summaries(pages[:, :, :8], cfg)
    with pytest.raises(ValueError, match="floating-point"):
        build_summaries(pages.long(), cfg)
    with pytest.raises(ValueError, match="D \\(head_dim\\)=0"):
        build_summaries(pages[..., :0], cfg)
    pages[1, 2, 3, 4] = float("nan")
    with pytest.raises(ValueError, match="keys contains 1 NaN/Inf"):
        build_summaries(pages, cfg)
    assert build_summaries(pages[:, :0], cfg).num_pages == 0  # no full page yet is fine


@pytest.mark.parametrize("fn", [score_pages, select_pages])
def test_score_and_select_refuse_a_config_that_is_not_the_summaries(qkv, summ, fn):
    q, _, _ = qkv
    s, cfg = summ
    with pytest.raises(ValueError, match="rank mismatch: config.rank=4 but summaries.rank=8"):
        fn(q, s, cfg.replace(rank=4))
    with pytest.raises(ValueError, match="basis_bits mismatch: config.basis_bits=8"):
        fn(q, s, cfg.replace(basis_bits=8))
    with pytest.raises(ValueError, match="page_size mismatch"):
        fn(q, s, LocksConfig(page_size=8, budget=32))
    with pytest.raises(ValueError, match="config must be a kvlocks.LocksConfig"):
        fn(q, s, None)
    with pytest.raises(ValueError, match="summaries must be kvlocks.PageSummaries"):
        fn(q, {"rank": 8}, cfg)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        fn(q[..., :8], s, cfg)
    with pytest.raises(ValueError, match="leading dims mismatch"):
        fn(q[:1], s, cfg)
    with pytest.raises(ValueError, match="G \\(query heads per KV head\\)=0"):
        fn(q[:, :0], s, cfg)
    with pytest.raises(ValueError, match="one device"):
        fn(q.to("meta"), s, cfg)
    with pytest.raises(ValueError, match="scale="):
        fn(q, s, cfg, scale=-1.0)
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="queries contains 1 NaN/Inf"):
        fn(bad, s, cfg)


def test_select_pages_refuses_an_empty_context(qkv, summ):
    q, k, _ = qkv
    _, cfg = summ
    empty = build_summaries(k[:, :0].unflatten(1, (0, S)), cfg)
    with pytest.raises(ValueError, match="0 pages"):
        select_pages(q, empty, cfg)
