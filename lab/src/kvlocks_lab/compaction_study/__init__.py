"""The compaction layer study: fold vs AM vs drop-beta vs rank-one, per layer, head and window.

Run it with ``kvlocks compaction-study --out DIR`` (see ``docs/compaction.md``).
"""
