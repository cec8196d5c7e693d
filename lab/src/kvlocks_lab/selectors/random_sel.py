"""Random baseline: sink + recent + uniformly random other pages, reproducible from a seed.

Each step draws one uniform score in ``[0, 1)`` per (leading row, page) — shared by the heads of
a GQA group, so the combined ranking is exactly a random permutation of the pages. The draw comes
from a CPU ``torch.Generator`` seeded with ``(seed, layer, N)``, mixed as
``((seed * 1_000_003) + layer) * 1_000_003 + N`` modulo 2**63, where ``layer`` is
``view.layer`` (0 when unset) and ``N`` the context length. So the same seed, layer and step give
the same pages on any device and in any call order, while different layers and steps differ.
Nothing is read to score: selection bytes are 0.
"""

from __future__ import annotations

import torch

from kvlocks.config import LocksConfig
from kvlocks.selection.pages import mask_empty_pages, page_mask

_MIX = 1_000_003


def step_seed(seed: int, layer: int, tokens: int) -> int:
    """The generator seed of one (layer, step): ``((seed * 1_000_003) + layer) * 1_000_003 + tokens``."""
    return ((seed * _MIX + layer) * _MIX + tokens) % (2**63)


class RandomSelector:
    """Seeded random page scores; see the module docstring for how a step's seed is formed.

    Parameters
    ----------
    seed : int
    """

    name = "random"
    needs_summaries = False
    reads_all_keys = False

    def __init__(self, *, seed: int = 0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"RandomSelector.seed={seed!r}: must be an integer")
        self.seed = seed

    def __repr__(self) -> str:
        return f"RandomSelector(seed={self.seed})"

    def page_scores(self, queries: torch.Tensor, view, config: LocksConfig) -> torch.Tensor:
        """queries ``[..., G, D]`` -> float32 ``[..., G, Pc]`` uniform scores, equal over G."""
        n = view.keys.shape[-2]
        pc = n // config.page_size
        gen = torch.Generator(device="cpu").manual_seed(step_seed(self.seed, view.layer or 0, n))
        draw = torch.rand((*queries.shape[:-2], 1, pc), generator=gen).to(queries.device)  # [..., 1, Pc]
        scores = draw.expand(*queries.shape[:-1], pc)  # [..., G, Pc]
        return mask_empty_pages(scores, page_mask(view.token_mask, config.page_size, pc))

    def bytes_per_page(self, config: LocksConfig, head_dim: int, elem_size: int) -> tuple[int, int]:
        return 0, 0

    def selection_bytes(self, config: LocksConfig, head_dim: int, elem_size: int, full_pages: int) -> float:
        return 0.0
