"""The question guard of key selection: exact closed-form and brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from kvlocks.compaction import CompactionConfig
from kvlocks.compaction.api import compact_head, compact_layer
from kvlocks.compaction.batched import prepare_layer, question_pass
from kvlocks.integrations.hf.compaction.capture import Capture
from kvlocks.compaction.select import (
    attention_scores, guarded_top_t, question_scores, guard_slots, select_attention,
)

PLANTED = 15


def planted(n_context: int = 200):
    """T = 20 keys in D = 2: ten broad keys [0, 3] (positions 0..9), one planted key [10, 0]
    (position 15), zeros elsewhere. Context rows [0, 1] read the broad keys; one question row
    [1, 0] reads the planted key. Scale 1.

    Context row weights: e^3 / (10 e^3 + 10) on each broad key, 1 / (10 e^3 + 10) elsewhere.
    Question row: e^10 / (e^10 + 19) on the planted key, 1 / (e^10 + 19) elsewhere. Over the
    201 pooled rows, the RMS of a broad key is 0.0993 and that of the planted key 0.0706: the
    planted key ranks 11th.
    """
    keys = torch.zeros(20, 2, dtype=torch.float64)
    keys[:10, 1] = 3.0
    keys[PLANTED, 0] = 10.0
    context = torch.tensor([[0.0, 1.0]], dtype=torch.float64).expand(n_context, 2)
    question = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    return keys, torch.cat([context, question]), question


def test_scores_match_the_closed_form():
    keys, q, question = planted()
    e3, e10 = math.exp(3.0), math.exp(10.0)
    broad_c, other_c = e3 / (10 * e3 + 10), 1 / (10 * e3 + 10)
    plant_q, other_q = e10 / (e10 + 19), 1 / (e10 + 19)
    rms = attention_scores(keys, q, scale=1.0)
    want_broad = math.sqrt((200 * broad_c ** 2 + other_q ** 2) / 201)
    want_plant = math.sqrt((200 * other_c ** 2 + plant_q ** 2) / 201)
    assert rms[0].item() == pytest.approx(want_broad, rel=1e-6)
    assert rms[PLANTED].item() == pytest.approx(want_plant, rel=1e-6)
    assert want_plant < want_broad  # the planted key loses on RMS
    got = question_scores(keys, question, scale=1.0)
    assert got[PLANTED].item() == pytest.approx(plant_q, rel=1e-6)
    assert got[0].item() == pytest.approx(other_q, rel=1e-5)


def test_guard_keeps_the_planted_key_and_plain_rms_drops_it():
    keys, q, question = planted()
    plain = select_attention(keys, q, 5, scale=1.0)
    assert plain.tolist() == [0, 1, 2, 3, 4]  # tied broad keys: the lower positions
    guarded = select_attention(keys, q, 5, scale=1.0, question=question, question_share=0.2)
    assert guarded.tolist() == [0, 1, 2, 3, PLANTED]  # g = 1 slot for the question's key
    off = select_attention(keys, q, 5, scale=1.0, question=question, question_share=0.0)
    assert torch.equal(off, plain)


def test_guard_slots():
    assert [guard_slots(t, 0.25) for t in (1, 2, 4, 980, 392)] == [0, 0, 1, 245, 98]
    assert guard_slots(7, 1.0) == 7 and guard_slots(7, 0.0) == 0


def _brute_force(scores, guards, t):
    """Per head: each guard's g best keys among those not yet taken, then the best scores of
    the rest (ties: lower position)."""
    out = []
    for h, s in enumerate(scores.tolist()):
        taken: list[int] = []
        for guard, g in guards:
            u = guard[h].tolist()
            taken += sorted((i for i in range(len(u)) if i not in taken), key=lambda i: (-u[i], i))[:g]
        rest = sorted((i for i in range(len(s)) if i not in taken), key=lambda i: (-s[i], i))[: t - len(taken)]
        out.append(sorted(taken + rest))
    return out


@pytest.mark.parametrize("t,g1,g2", [(1, 0, 0), (1, 1, 0), (1, 0, 1), (17, 5, 0), (17, 17, 0),
                                     (17, 5, 7), (50, 12, 30), (20, 10, 10)])
def test_guarded_top_t_matches_brute_force(t, g1, g2):
    gen = torch.Generator().manual_seed(t * 100 + g1 * 10 + g2)
    scores = torch.rand(3, 50, generator=gen)
    first = torch.rand(3, 50, generator=gen)
    second = first.clone()  # overlapping preferences: the second guard must skip what the first took
    second[:, ::2] = torch.rand(3, 25, generator=gen)
    scores[:, 10:14] = 0.5  # ties in all three
    first[:, 20:25] = 0.25
    second[:, 30:35] = 0.75
    guards = [(first, g1), (second, g2)]
    assert guarded_top_t(scores, guards, t).tolist() == _brute_force(scores, guards, t)
    assert guarded_top_t(scores, [(None, t)], t).tolist() == _brute_force(scores, [], t)
    with pytest.raises(ValueError, match="sum to <= t"):
        guarded_top_t(scores, [(first, t), (second, 1)], t)


def _layer(heads: int = 2):
    """A layer of ``heads`` copies of the planted case (values random), as float32."""
    keys, q, question = planted()
    gen = torch.Generator().manual_seed(0)
    k = keys.float().expand(heads, -1, -1).clone()
    v = torch.randn(heads, 20, 4, generator=gen)
    return k, v, q.float().expand(heads, -1, -1).clone(), question.float().expand(heads, -1, -1).clone()


def test_question_pass_matches_the_reference():
    k, _, _, question = _layer()
    ref = torch.stack([question_scores(k[h], question[h], scale=0.7) for h in range(2)])
    torch.testing.assert_close(question_pass(k, question, 0.7), ref)


@pytest.mark.parametrize("method", ["fold", "am", "drop_refit"])
def test_batched_and_per_head_paths_keep_the_planted_key(method):
    k, v, q, question = _layer()
    cfg = CompactionConfig(method=method, question_share=0.2, coverage_share=0.0, max_queries=4096)
    layer = compact_layer(k, v, q, 5, cfg, scale=1.0, question=question)  # batched path
    for h in range(2):
        assert layer.indices[h].tolist() == [0, 1, 2, 3, PLANTED]
        head = compact_head(k[h], v[h], q[h], 5, cfg, scale=1.0, question=question[h])
        assert torch.equal(head.indices, layer.indices[h])
    plain = compact_layer(k, v, q, 5, cfg, scale=1.0)
    assert plain.indices.tolist() == [[0, 1, 2, 3, 4]] * 2


def test_share_zero_and_no_question_give_the_plain_result():
    k, v, q, question = _layer()
    gen = torch.Generator().manual_seed(1)
    k = k + 0.3 * torch.randn(k.shape, generator=gen)  # no ties: a generic layer
    plain = compact_layer(k, v, q, 6, CompactionConfig(method="fold"), scale=1.0)
    off = compact_layer(k, v, q, 6, CompactionConfig(method="fold", question_share=0.0), scale=1.0,
                        question=question)
    for name in ("keys", "values", "indices", "u", "fitted_bias"):
        assert torch.equal(getattr(plain, name), getattr(off, name)), name
    assert prepare_layer(k, v, q, CompactionConfig(question_share=0.0), 1.0, question=question).question is None


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True])
def test_config_rejects_bad_share(bad):
    with pytest.raises(ValueError, match="question_share"):
        CompactionConfig(question_share=bad)


def test_question_shape_errors_name_the_tensor():
    k, v, q, question = _layer()
    cfg = CompactionConfig(question_share=0.2)
    for bad in (question[:1], question[..., :1], question[:, :0], question[0]):
        with pytest.raises(ValueError, match="question"):
            compact_layer(k, v, q, 5, cfg, scale=1.0, question=bad)
    nan = question.clone()
    nan[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="question contains"):
        compact_layer(k, v, q, 5, cfg, scale=1.0, question=nan)


def test_capture_only_gives_the_question_rows():
    ctx = torch.arange(12.0).reshape(1, 6, 2)
    qst = -torch.arange(1.0, 7.0).reshape(1, 3, 2)
    cap = Capture(keys=(torch.zeros(1, 4, 2),), values=(torch.zeros(1, 4, 2),), queries=(ctx,),
                  scales=(1.0,), counts={}, by_pass={"context": (ctx,), "question_0": (qst,)},
                  prefix_len=4, seconds=0.0, max_queries=5, seed=0)
    with_q = cap.only(["context", "question_0"])
    assert torch.equal(with_q.questions[0], qst)
    assert torch.equal(with_q.queries[0][:, :3], qst)  # kept whole, ahead of the context rows
    assert cap.only(["context"]).questions is None
