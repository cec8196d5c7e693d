"""kvlocks: cheaper long-context decoding.

LOCKS sparse decode (page-local compact key summaries) and Attention-Matching compaction with
bias folding. Importing kvlocks changes nothing in torch, transformers or vLLM.
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
