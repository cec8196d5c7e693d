import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def heavy_first(items, chunk=2):
    """The order of a GPU run under pytest-xdist (``scripts/gpu/gpu_tests.sh``): the items marked
    ``compile_heavy(seconds)``, longest first, each followed by ``chunk - 1`` light items, then the
    remaining light items in their order. With xdist's ``--maxschedchunk chunk`` the first chunks
    give each worker one heavy item, so the longest tests start at once instead of queueing behind
    one worker (that way the whole kernel suite once ran past its 570 s limit)."""
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


# ``--file-summary`` (scripts/test.sh): a table of counts and seconds per test file at the end.
_FILE_COUNTS: dict[str, dict] = {}


def pytest_addoption(parser):
    parser.addoption("--file-summary", action="store_true",
                     help="end with one line per test file: passed / failed / skipped and seconds")


def pytest_runtest_logreport(report):
    c = _FILE_COUNTS.setdefault(report.nodeid.split("::")[0], {"passed": 0, "failed": 0, "skipped": 0, "s": 0.0})
    c["s"] += report.duration
    if report.when == "call" or report.outcome != "passed":
        c[report.outcome] += 1


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("file_summary") or not _FILE_COUNTS:
        return
    terminalreporter.section("per test file")
    width = max(map(len, _FILE_COUNTS))
    for path, c in _FILE_COUNTS.items():
        terminalreporter.write_line(f"{path:<{width}}  {c['passed']:4d} passed  {c['failed']:3d} failed  "
                                    f"{c['skipped']:3d} skipped  {c['s']:7.1f} s")
