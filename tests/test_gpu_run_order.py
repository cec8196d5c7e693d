"""The order of the GPU test run under pytest-xdist (``heavy_first`` in tests/conftest.py)."""

import pytest
from conftest import heavy_first


class _Item:
    """The one thing ``heavy_first`` reads of a pytest item: its ``compile_heavy`` marker."""

    def __init__(self, name, seconds=None):
        self.name = name
        self._mark = None if seconds is None else pytest.mark.compile_heavy(seconds).mark

    def get_closest_marker(self, name):
        return self._mark if name == "compile_heavy" else None


def _names(items):
    return [it.name for it in items]


def test_heavy_items_lead_one_chunk_each_longest_first():
    items = [_Item("a"), _Item("b"), _Item("h10", 10), _Item("c"), _Item("h30", 30), _Item("d")]
    assert _names(heavy_first(items)) == ["h30", "a", "h10", "b", "c", "d"]
    assert _names(heavy_first(items, chunk=3)) == ["h30", "a", "b", "h10", "c", "d"]
    # more heavy items than light ones: the heavy ones still come longest first, none lost
    few = [_Item("h1", 1), _Item("a"), _Item("h5", 5), _Item("h3", 3)]
    assert _names(heavy_first(few)) == ["h5", "a", "h3", "h1"]


def test_without_heavy_items_the_order_is_kept():
    items = [_Item(n) for n in "xyzw"]
    assert _names(heavy_first(items)) == list("xyzw")
