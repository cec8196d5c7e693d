"""Attention-Matching KV compaction with bias folding (pure PyTorch, one KV head at a time).

See ``docs/compaction.md`` and "Folding Attention Biases into Keys Makes Compacted KV Caches Run on
Standard Kernels" (Kanwat, arXiv, 2026). Entry points:
:func:`compact_head` and :func:`compact_layer`; the building blocks are exported for studies. A whole
model's capture, compaction and serving: :mod:`kvlocks.integrations.hf.compaction`.
"""

from .api import CompactedHead, CompactedLayer, compact_head, compact_layer, subsample_queries
from .bias import fit_bias, mass_design, partition_targets
from .config import METHODS, ROUND_DTYPES, SELECTIONS, CompactionConfig
from .fold import (FoldResult, fold_direction, fold_error_bound, fold_head, fold_keys,
                   query_alignment, query_moments)
from .merge import MergeResult, cluster_labels, merge_duplicates, merge_to_budget
from .rank1 import augment_keys, augment_queries
from .select import attention_scores, select_attention, select_keys, select_omp, top_t
from .values import attention_weights, exact_attention, refit_values

__all__ = [
    "CompactedHead", "CompactedLayer", "CompactionConfig", "FoldResult", "METHODS",
    "MergeResult", "ROUND_DTYPES", "SELECTIONS", "attention_scores", "attention_weights",
    "augment_keys", "augment_queries", "cluster_labels", "compact_head", "compact_layer",
    "exact_attention", "fit_bias", "fold_direction", "fold_error_bound", "fold_head",
    "fold_keys", "mass_design", "merge_duplicates", "merge_to_budget", "partition_targets",
    "query_alignment", "query_moments", "refit_values", "select_attention", "select_keys",
    "select_omp", "subsample_queries", "top_t",
]
