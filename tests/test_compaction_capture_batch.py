"""Generating reference passes run as one batch record what they record one after another."""

from __future__ import annotations

import torch

from kvlocks.integrations.hf.compaction.capture import capture_queries
from kvlocks.integrations.hf.compaction.capture_batch import groups
from kvlocks.integrations.hf.compaction.passes import QueryPass


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().to(torch.float64)


def _passes():
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, 97, (1, n), generator=g)  # noqa: E731
    return [QueryPass("repeat", ids(20), segments=((10, 40), (10, 60))),
            QueryPass("self_study_0", ids(7), generate=9), QueryPass("self_study_1", ids(4), generate=9),
            QueryPass("self_study_2", ids(11), generate=9), QueryPass("question_0", ids(5), generate=3)]


def test_groups_are_consecutive_generating_passes_of_one_length():
    names = [[p.name for p in grp] for grp in groups(_passes())]
    assert names == [["repeat"], ["self_study_0", "self_study_1", "self_study_2"], ["question_0"]]


def test_batched_passes_record_the_rows_of_the_sequential_run():
    model = _tiny()
    prefix = torch.randint(0, 97, (1, 37), generator=torch.Generator().manual_seed(2))
    seen = []
    one = capture_queries(model, prefix, _passes(), max_queries=24, seed=3, batch=False)
    many = capture_queries(model, prefix, _passes(), max_queries=24, seed=3, batch=True, progress=seen.append)
    assert "self_study_0 + self_study_1 + self_study_2" in seen
    assert one.counts == many.counts and one.counts["self_study_1"] == (4 + 9) * 2  # G = 2 rows per token
    for name in one.by_pass:
        for a, b in zip(one.by_pass[name], many.by_pass[name]):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-9, rtol=0), name
    for a, b in zip(one.queries, many.queries):
        assert torch.allclose(a, b, atol=1e-9, rtol=0)
    for a, b in zip(one.keys, many.keys):
        assert torch.equal(a, b)  # the prefix's cache is left as it was
