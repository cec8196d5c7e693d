"""The baseline selectors kvlocks is compared with, one module each (kvpress style).

Each is a :class:`kvlocks.selection.Selector` and is registered by name in the
``kvlocks.selectors`` entry-point group (pyproject.toml), so ``get_selector("quest")``,
``LocksCache(..., method="quest")`` and ``kvlocks generate --method quest`` find it:

- ``oracle_per_head``: exact per-page mass, each query head its own pages;
- ``quest``: per-page key envelopes (an upper bound on q.k);
- ``loki``: a shared PCA basis calibrated offline; ``shadowkv``: a per-sequence low-rank basis;
- ``centroid``: per-sub-page key means; ``streaming``: sink + recent only; ``random``.

:func:`matched_selector` builds one at LOCKS's bytes per page (:mod:`.matched_bytes`).
"""

from kvlocks.config import LocksConfig
from kvlocks_lab.selectors.centroid import CentroidSelector
from kvlocks_lab.selectors.loki import LokiCalibration, LokiSelector, calibrate
from kvlocks_lab.selectors.matched_bytes import locks_page_bytes, matched_settings
from kvlocks_lab.selectors.oracle_per_head import OraclePerHeadSelector
from kvlocks_lab.selectors.quest import QuestSelector
from kvlocks_lab.selectors.random_sel import RandomSelector
from kvlocks_lab.selectors.shadowkv import ShadowKVSelector
from kvlocks_lab.selectors.streaming import StreamingSelector

_MATCHABLE = {"quest": QuestSelector, "centroid": CentroidSelector, "loki": LokiSelector, "shadowkv": ShadowKVSelector}


def matched_selector(name: str, config: LocksConfig, head_dim: int, *, bits: int | None = None, **selector_kwargs):
    """A selector instance at LOCKS's bytes per page (:mod:`.matched_bytes`), e.g.
    ``matched_selector("loki", cfg, 64, calibration=calib)``."""
    settings = matched_settings(name, config, head_dim, **({} if bits is None else {"bits": bits}))
    return _MATCHABLE[name](**selector_kwargs, **settings)


__all__ = [
    "CentroidSelector", "LokiCalibration", "LokiSelector", "OraclePerHeadSelector", "QuestSelector",
    "RandomSelector", "ShadowKVSelector", "StreamingSelector", "calibrate", "locks_page_bytes",
    "matched_selector", "matched_settings",
]
