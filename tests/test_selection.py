import pytest
import torch

from kvlocks import LocksConfig, build_summaries, select_pages
from kvlocks.scoring import combine_group, exact_page_lse
from kvlocks.selection import LayerView, choose_pages, get_selector, select_top_pages


def test_sink_and_recent_always_selected_and_deterministic():
    c = LocksConfig(budget=64)
    pages = torch.randn(3, 20, 16, 64)
    s = build_summaries(pages, c)
    for _ in range(5):
        q = torch.randn(3, 4, 64) * 5
        sel = select_pages(q, s, c)
        assert sel.shape == (3, 4)
        assert bool((sel[:, 0] == 0).all()) and bool((sel[:, -1] == 19).all())
        assert torch.equal(sel, select_pages(q, s, c))
        assert bool((sel[:, 1:] > sel[:, :-1]).all())  # ascending, distinct


def test_top_pages_follow_the_combined_ranking():
    ranking = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0, 0.5]])
    got = select_top_pages(ranking, 6, 4)
    assert got.tolist() == [[0, 1, 3, 5]]  # sink 0, recent 5, then pages 1 (5.0) and 3 (4.0)


def test_ties_go_to_the_lower_page_index():
    ranking = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert select_top_pages(ranking, 7, 4).tolist() == [[0, 1, 2, 6]]


def test_partial_page_is_recent_and_budget_caps_at_all_pages():
    ranking = torch.tensor([[0.0, 1.0, 2.0]])
    assert select_top_pages(ranking, 4, 3).tolist() == [[0, 2, 3]]  # page 3 is partial
    assert select_top_pages(ranking, 4, 100).tolist() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="total_pages"):
        select_top_pages(ranking, 5, 3)


def test_sink_moves_with_left_padding():
    ranking = torch.tensor([[9.0, 9.0, 0.0, 1.0, 0.0], [9.0, 9.0, 0.0, 1.0, 0.0]])
    got = select_top_pages(ranking, 6, 3, sink_start=torch.tensor([0, 2]))
    assert got.tolist() == [[0, 1, 5], [0, 2, 5]]


def test_oracle_is_the_exact_top_k_of_group_mean_share():
    c = LocksConfig(budget=96)
    keys = torch.randn(2, 10 * 16 + 5, 32)
    q = torch.randn(2, 3, 32)
    view = LayerView(keys=keys, summaries=None, token_mask=None, scale=32**-0.5)
    got = choose_pages(q, view, c, get_selector("oracle"))
    # brute force: exact shares, forced pages {0, 10 (partial)}, best 4 of pages 1..9
    shares = torch.softmax(exact_page_lse(q, keys, 16), dim=-1).mean(dim=1)  # [2, 10]
    for h in range(2):
        order = sorted(range(1, 10), key=lambda j: (-float(shares[h, j]), j))
        assert got[h].tolist() == sorted([0, 10] + order[:4])


def test_locks_selector_matches_oracle_when_summaries_are_exact():
    c = LocksConfig(budget=64, rank=16, basis_bits=16, coef_bits=16)
    keys = torch.randn(2, 12 * 16, 32)
    q = torch.randn(2, 4, 32)
    s = build_summaries(keys.unflatten(1, (12, 16)), c)
    view = LayerView(keys=keys, summaries=s, token_mask=None, scale=32**-0.5)
    oracle = choose_pages(q, view, c, get_selector("oracle"))
    locks = choose_pages(q, view, c, get_selector("locks"))
    assert torch.equal(oracle, locks)


def test_padding_pages_never_chosen_by_score():
    c = LocksConfig(budget=48)
    keys = torch.randn(1, 6 * 16, 32)
    keys[0, :32] *= 50  # padding keys with huge logits must not attract selection
    mask = torch.ones(1, 96, dtype=torch.bool)
    mask[0, :32] = False
    q = keys[0, 40:41].clone() + 0.0
    view = LayerView(keys=keys, summaries=None, token_mask=mask, scale=32**-0.5)
    got = choose_pages(q, view, c, get_selector("oracle"))
    assert got.tolist()[0][0] == 2  # sink = first page with a real token
    assert 0 not in got.tolist()[0] and 1 not in got.tolist()[0]


def test_unknown_selector():
    with pytest.raises(ValueError, match="unknown selector"):
        get_selector("nope")
