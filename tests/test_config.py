import pytest

from kvlocks import LocksConfig


def test_defaults_are_the_shipped_configuration():
    c = LocksConfig()
    assert (c.page_size, c.rank, c.basis_bits, c.coef_bits, c.combine) == (16, 8, 4, 8, "mean_share")
    assert c.pages_per_step == c.budget // 16


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"budget": 100}, "budget"),  # not a multiple of page_size
        ({"budget": 16}, "budget"),  # fewer than 2 pages
        ({"budget": 48, "sink_pages": 2, "recent_pages": 2}, "budget"),  # fewer than forced pages
        ({"rank": 0}, "rank"),
        ({"rank": 17}, "rank"),
        ({"basis_bits": 3}, "basis_bits"),
        ({"coef_bits": 4}, "coef_bits"),
        ({"combine": "vote"}, "combine"),
        ({"page_size": 1}, "page_size"),
        ({"rank": 2.0}, "rank"),
        ({"recent_pages": 0}, "recent_pages"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LocksConfig.{field}="):
        LocksConfig(**kwargs)


def test_frozen_and_keyword_only():
    c = LocksConfig()
    with pytest.raises(Exception):
        c.rank = 4
    with pytest.raises(TypeError):
        LocksConfig(16)  # positional arguments are not accepted


def test_json_round_trip_and_unknown_fields():
    c = LocksConfig(budget=512, rank=4, combine="max_share")
    assert LocksConfig.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="unknown fields"):
        LocksConfig.from_json('{"bugdet": 256}')
    with pytest.raises(ValueError, match="not valid JSON"):
        LocksConfig.from_json("{")
