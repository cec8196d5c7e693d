"""Which configurations and shapes the paged path supports: the rule, written once.

Two layers:

- the paged summary store and the PyTorch references over it (backend ``"torch"``): int4 basis
  and int8 coefficients (``basis_bits=4``, ``coef_bits=8``), an even head_dim (two int4 per byte);
  any page size and rank;
- the Triton kernels (backend ``"triton"``): also 16-token pages (the build's Jacobi pairings and
  the kernels' tiles are written for them), head_dim 64, 128 or 256, a power-of-two rank. The CUDA
  score kernel covers head_dim 64 and 128 only (:data:`CUDA_HEAD_DIMS`); at 256 :func:`score_kernel`
  picks a Triton score kernel.

:func:`kernel_support` says why a configuration is outside them (None when it is inside);
:func:`check_config` raises that reason as a ``ValueError``. Where a caller has a fallback it
states it (the Hugging Face cache runs the references: :func:`kvlocks.integrations.hf.kernel_path`);
everywhere else an unsupported configuration is an error, never a silently different kernel.

:func:`score_kernel` picks among the three score kernels of a supported configuration by the
queries' device, dtype and group size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

STORE_BITS = (4, 8)  # (basis_bits, coef_bits) of the paged summary store
KERNEL_PAGE_SIZE = 16
KERNEL_HEAD_DIMS = (64, 128, 256)
# The CUDA score kernel's compiled head dims. At 256 its static shared memory would be 87 KB for
# G <= 16 (queries 16 KB + two group slots of 4.7 KB and two centroid slots of 4 KB per warp, 4
# warps), over the 48 KB a kernel may declare statically: it would need dynamic shared memory.
CUDA_HEAD_DIMS = (64, 128)
KERNEL_RANKS = (1, 2, 4, 8, 16)
BACKENDS = ("torch", "triton")
FAST_SCORE_RANK = 8  # the CUDA and packed score kernels: rank 8, G from 1 to MAX_FAST_GROUP
MAX_FAST_GROUP = 16
CUDA_TILE = 16  # the CUDA score kernel's pages per warp step: its launches split rows in whole tiles


def kernel_support(*, page_size: int, rank: int, head_dim: int | None, basis_bits: int = 4, coef_bits: int = 8,
                   backend: str = "triton") -> str | None:
    """Why the paged path cannot run this configuration on ``backend`` (a sentence naming the
    field, its value and what is allowed), or None when it can. ``head_dim`` None: not checked
    (a configuration not yet bound to a model)."""
    if backend not in BACKENDS:
        return f"backend={backend!r}: allowed {BACKENDS}"
    if (basis_bits, coef_bits) != STORE_BITS:
        return (f"the paged summary store holds int4 basis / int8 coefficients: basis_bits=4 and coef_bits=8 "
                f"allowed, got basis_bits={basis_bits}, coef_bits={coef_bits}")
    if head_dim is not None and head_dim % 2:
        return f"head_dim={head_dim}: must be even (two int4 basis values per byte)"
    if backend == "torch":
        return None
    if page_size != KERNEL_PAGE_SIZE:
        return f"page_size={page_size}: the Triton kernels support page_size={KERNEL_PAGE_SIZE} only"
    if rank not in KERNEL_RANKS:
        return f"rank={rank}: the Triton kernels support ranks {KERNEL_RANKS}"
    if head_dim is not None and head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim={head_dim}: the Triton kernels support head_dim in {KERNEL_HEAD_DIMS}"
    return None


def check_config(config, head_dim: int | None, *, backend: str, owner: str = "LocksConfig") -> None:
    """Raise ``ValueError`` with :func:`kernel_support`'s reason for a ``LocksConfig``."""
    why = kernel_support(page_size=config.page_size, rank=config.rank, head_dim=head_dim,
                         basis_bits=config.basis_bits, coef_bits=config.coef_bits, backend=backend)
    if why is not None:
        raise ValueError(f"{owner}: {why}")


def score_kernel(queries: torch.Tensor, group: int, rank: int, pages_per_program: int, *, choice: str = "auto",
                 cuda_library: Callable[[], bool] = lambda: False) -> str:
    """The score kernel for ``queries [B, Hq, D]`` of a supported configuration.

    ``"cuda"`` (``scoring/score_mma.cu``): CUDA, float16/bfloat16 queries with unit stride along
    D, D in :data:`CUDA_HEAD_DIMS`, G from 1 to 16, rank 8, a launch of whole 16-page tiles per program, and its library
    compiled (``cuda_library()``, asked last: it compiles at first use). ``"packed"``
    (:mod:`kvlocks.scoring.triton_packed`): for ``"auto"`` CUDA, float16/bfloat16, G from 1 to 16
    and rank 8 (pinned: any queries, G from 1 to 16, rank 8 or 16), measured faster than the three-dot kernel there (H200, 1M
    tokens: G = 1 1255 vs 3836 us, G = 4 / 8 about 2x, G = 16 236 vs 275 us; docs/benchmarks.md).
    ``"mma"``: the three-dot Triton kernel, everything else. ``choice`` pins one; ValueError
    naming what it needs where it cannot run.
    """
    half = queries.is_cuda and queries.dtype in (torch.float16, torch.bfloat16)
    fast = half and 1 <= group <= MAX_FAST_GROUP
    need = {
        "cuda": (fast and rank == FAST_SCORE_RANK and queries.stride(-1) == 1
                 and queries.shape[-1] in CUDA_HEAD_DIMS and pages_per_program % CUDA_TILE == 0,
                 f"CUDA float16/bfloat16 queries with unit stride along D, D in {CUDA_HEAD_DIMS}, G in "
                 f"1..{MAX_FAST_GROUP}, rank {FAST_SCORE_RANK} and pages per program a multiple of {CUDA_TILE}"),
        "packed": (1 <= group <= MAX_FAST_GROUP and rank in (FAST_SCORE_RANK, 16),
                   f"G in 1..{MAX_FAST_GROUP} and rank 8 or 16"),
    }
    got = (f"got {queries.device.type} {queries.dtype}, D={queries.shape[-1]}, G={group}, rank={rank}, "
           f"pages per program {pages_per_program}")
    if choice in need:
        ok, what = need[choice]
        if not ok:
            raise ValueError(f"score kernel {choice!r} needs {what}; {got}")
        if choice == "cuda" and not cuda_library():
            raise ValueError("score kernel 'cuda': its library is unavailable here (see "
                             "kvlocks.scoring.cuda_mma.unavailable_reason)")
        return choice
    if choice == "mma":
        return "mma"
    if choice != "auto":
        raise ValueError(f"score kernel {choice!r}: allowed ('auto', 'cuda', 'packed', 'mma')")
    if need["cuda"][0] and cuda_library():
        return "cuda"
    if fast and rank == FAST_SCORE_RANK:
        return "packed"
    return "mma"
