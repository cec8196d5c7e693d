import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def heavy_first(items, chunk=2):
    """The order of a GPU run under pytest-xdist (``scripts/device/gpu_tests.sh``): the items marked
    ``compile_heavy(seconds)``, longest first, each followed by ``chunk - 1`` light items, then the
    remaining light items in their order. With xdist's ``--maxschedchunk chunk`` the first chunks
    give each worker one heavy item, so the longest tests start at once instead of queueing behind
    one worker (session 15: the whole kernel suite ran past its 570 s limit that way)."""
    def cost(it):
        mark = it.get_closest_marker("compile_heavy")
        return None if mark is None else float(mark.args[0])

    heavy = sorted((it for it in items if cost(it) is not None), key=lambda it: -cost(it))
    light = [it for it in items if cost(it) is None]
    out = []
    for it in heavy:
        out.append(it)
        out.extend(light[:chunk - 1])
        light = light[chunk - 1:]
    return out + light


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVLOCKS_HEAVY_FIRST") == "1":
        items[:] = heavy_first(items)


def low_rank_pages(lead, pages, page_size, dim, rank, *, scale=1.0):
    """Pages whose centred keys have rank <= ``rank``: mu + coeffs @ basis."""
    mu = torch.randn(*lead, pages, 1, dim) * scale
    basis = torch.randn(*lead, pages, rank, dim)
    coef = torch.randn(*lead, pages, page_size, rank) * scale
    return mu + coef @ basis
