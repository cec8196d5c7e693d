"""Page selection: the selector interface, the LOCKS and oracle selectors, and top-k."""

from kvlocks.selection.selectors import SELECTORS, LayerView, Selector, choose_pages, get_selector
from kvlocks.selection.topk import select_top_pages

__all__ = ["SELECTORS", "LayerView", "Selector", "choose_pages", "get_selector", "select_top_pages"]
