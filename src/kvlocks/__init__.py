"""kvlocks: cheaper long-context decoding.

LOCKS sparse decode (page-local compact key summaries) and Attention-Matching compaction with
bias folding. Importing kvlocks changes nothing in torch, transformers or vLLM.

The functional API (:mod:`kvlocks.api`, one function per operation, shapes in each docstring):
``build_summaries``, ``score_pages``, ``select_pages``, ``sparse_decode``, ``dense_decode``, with
the types ``LocksConfig`` and ``PageSummaries``. Models: :mod:`kvlocks.models`; Hugging Face
generation: :mod:`kvlocks.integrations.hf`; compaction: :mod:`kvlocks.compaction`.
"""

from kvlocks.api import (
    LocksConfig,
    PageSummaries,
    build_summaries,
    dense_decode,
    score_pages,
    select_pages,
    sparse_decode,
)

__version__ = "0.1.0"

__all__ = [
    "LocksConfig", "PageSummaries", "build_summaries", "dense_decode", "score_pages",
    "select_pages", "sparse_decode", "__version__",
]
