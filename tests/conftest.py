import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def low_rank_pages(lead, pages, page_size, dim, rank, *, scale=1.0):
    """Pages whose centred keys have rank <= ``rank``: mu + coeffs @ basis."""
    mu = torch.randn(*lead, pages, 1, dim) * scale
    basis = torch.randn(*lead, pages, rank, dim)
    coef = torch.randn(*lead, pages, page_size, rank) * scale
    return mu + coef @ basis
