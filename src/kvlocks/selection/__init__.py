"""Page selection: the selector interface, the selectors (LOCKS, oracles, baselines) and top-k."""

from kvlocks.selection.centroid import CentroidSelector
from kvlocks.selection.loki import LokiCalibration, LokiSelector, calibrate
from kvlocks.selection.matched_bytes import locks_page_bytes, matched_settings
from kvlocks.selection.oracle_per_head import OraclePerHeadSelector, sparse_decode_per_head
from kvlocks.selection.quest import QuestSelector
from kvlocks.selection.random_sel import RandomSelector
from kvlocks.selection.selectors import SELECTORS, LayerView, Selector, choose_pages, get_selector, matched_selector
from kvlocks.selection.shadowkv import ShadowKVSelector
from kvlocks.selection.streaming import StreamingSelector
from kvlocks.selection.topk import select_top_pages

__all__ = [
    "SELECTORS", "CentroidSelector", "LayerView", "LokiCalibration", "LokiSelector", "OraclePerHeadSelector",
    "QuestSelector", "RandomSelector", "Selector", "ShadowKVSelector", "StreamingSelector", "calibrate",
    "choose_pages", "get_selector", "locks_page_bytes", "matched_selector", "matched_settings",
    "select_top_pages", "sparse_decode_per_head",
]
