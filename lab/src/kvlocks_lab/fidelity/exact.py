"""One layer's captured activations and the exact quantities every metric compares against.

Shapes: H = KV heads measured, Q = query steps, G = query heads per KV head, P = pages of the
prefix (all full: the prefix is a whole number of pages), S = page size, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class LayerData:
    """Captured activations of one layer (a subset of KV heads).

    keys, values : float32 ``[H, N, D]`` (N = P * S)
    queries : float32 ``[H, Q, G, D]``
    scale : softmax scale
    page_size : S
    layer : layer index (Loki and the global basis are per layer)
    carrier_pages : pages holding the needle value (empty: no needle)
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    scale: float
    page_size: int
    layer: int
    carrier_pages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        h, n, d = self.keys.shape
        if n % self.page_size or self.values.shape != self.keys.shape:
            raise ValueError(f"keys/values {tuple(self.keys.shape)} / {tuple(self.values.shape)}: "
                             f"N must be a multiple of page_size={self.page_size}")
        if self.queries.dim() != 4 or self.queries.shape[0] != h or self.queries.shape[-1] != d:
            raise ValueError(f"queries must be [H={h}, Q, G, D={d}], got {tuple(self.queries.shape)}")

    @property
    def num_pages(self) -> int:
        return self.keys.shape[1] // self.page_size

    @property
    def pages(self) -> torch.Tensor:
        """Float32 ``[H, P, S, D]`` keys by page."""
        return self.keys.unflatten(1, (self.num_pages, self.page_size))

    @property
    def flat_queries(self) -> torch.Tensor:
        """``[H, Q*G, D]``: every (step, query head) as one row, for per-head selector scoring."""
        return self.queries.flatten(1, 2)

    def unflatten(self, x: torch.Tensor) -> torch.Tensor:
        """``[H, Q*G, ...]`` -> ``[H, Q, G, ...]``."""
        return x.unflatten(1, self.queries.shape[1:3])

    def carrier_mask(self) -> torch.Tensor | None:
        """Bool ``[P]`` (True = carrier page), or None without carriers."""
        if not self.carrier_pages:
            return None
        m = torch.zeros(self.num_pages, dtype=torch.bool)
        m[list(self.carrier_pages)] = True
        return m


@dataclass(frozen=True, eq=False)
class ExactLayer:
    """Dense reference of one layer.

    logits : float32 ``[H, Q, G, P, S]``, exact scaled logits
    lse : float32 ``[H, Q, G, P]``, exact page log-sum-exp s_j(q)
    share : float32 ``[H, Q, G, P]``, exact page-mass share (softmax of ``lse`` over pages)
    page_out : float32 ``[H, Q, G, P, D]``, attention output within each page alone
    out : float32 ``[H, Q, G, D]``, dense (FullKV over the prefix) attention output
    """

    logits: torch.Tensor
    lse: torch.Tensor
    share: torch.Tensor
    page_out: torch.Tensor
    out: torch.Tensor


def exact_layer(data: LayerData) -> ExactLayer:
    """The exact logits, page masses and outputs of every query against the prefix."""
    pages = data.pages  # [H, P, S, D]
    vpages = data.values.unflatten(1, (data.num_pages, data.page_size))  # [H, P, S, D]
    logits = torch.einsum("hqgd,hpsd->hqgps", data.queries.float(), pages) * data.scale  # [H, Q, G, P, S]
    lse = torch.logsumexp(logits, dim=-1)  # [H, Q, G, P]
    share = torch.softmax(lse, dim=-1)
    within = torch.softmax(logits, dim=-1)  # [H, Q, G, P, S]
    page_out = torch.einsum("hqgps,hpsd->hqgpd", within, vpages)  # [H, Q, G, P, D]
    out = torch.einsum("hqgp,hqgpd->hqgd", share, page_out)
    return ExactLayer(logits=logits, lse=lse, share=share, page_out=page_out, out=out)
