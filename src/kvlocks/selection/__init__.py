"""Page selection: the selector interface, LOCKS and the oracle, and sink + recent + top-k.

Baseline selectors (Quest, Loki, ShadowKV, ...) live in the lab (:mod:`kvlocks_lab.selectors`)
and are found by name through the ``kvlocks.selectors`` entry-point group.
"""

from kvlocks.selection.selectors import (SELECTORS, LayerView, LocksSelector, OracleSelector, Selector, choose_pages,
                                         get_selector, selector_names)
from kvlocks.selection.topk import select_top_pages

__all__ = [
    "SELECTORS", "LayerView", "LocksSelector", "OracleSelector", "Selector", "choose_pages", "get_selector",
    "select_top_pages", "selector_names",
]
