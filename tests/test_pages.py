"""Page arithmetic (kvlocks.pages): the same counts on ints and on integer tensors."""

import torch

from kvlocks.pages import full_pages, num_pages

TOKENS = [0, 1, 15, 16, 17, 31, 32, 1000]


def test_counts_on_ints():
    assert [num_pages(n, 16) for n in TOKENS] == [0, 1, 1, 1, 2, 2, 2, 63]
    assert [full_pages(n, 16) for n in TOKENS] == [0, 0, 0, 1, 1, 1, 2, 62]
    assert num_pages(5, 1) == full_pages(5, 1) == 5


def test_tensors_match_ints():
    for dtype in (torch.int32, torch.int64):
        t = torch.tensor(TOKENS, dtype=dtype)
        assert num_pages(t, 16).tolist() == [num_pages(n, 16) for n in TOKENS]
        assert full_pages(t, 16).tolist() == [full_pages(n, 16) for n in TOKENS]
        assert num_pages(t, 16).dtype == dtype
