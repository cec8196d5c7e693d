"""Compaction methods in the task suite: an adapter over :mod:`kvlocks.compaction`'s public API.

Per record, the context prefix (everything before the question) is compacted once per
compaction source and ratio, and every method decodes the rest of the record over a plain
transformers cache built from it (:func:`kvlocks.integrations.hf.compaction.serve.to_cache`), continuing at
logical position T.

Cost control (compaction takes minutes per record at 4K+ on a CPU):

- the reference queries are captured once per record (one prefill plus the repeat and
  self-study passes) and shared by every compaction method and ratio;
- ``am``, ``drop`` and ``rank1`` are one fit: ``drop`` is AM's keys and values with beta
  discarded and ``rank1`` stores the same beta as key coordinate D, so both are derived from
  the ``am`` result (a test checks them against direct compaction);
- each fitted prefix is saved under the run directory (``DIR/compacted/``) as soon as it is
  made, so an interrupted run resumes without refitting, and the files are deleted when the
  record's rows are all written.

Device: the compaction package's fits run on the CPU (scipy's bounded least squares and numpy
selection), so with ``--device cuda`` the capture runs on the GPU and its K/V are moved to the
CPU for the fit; the served cache goes back to the model's device and dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kvlocks.config_io import ConfigIO, check_int

log = logging.getLogger(__name__)

DERIVED_FROM_AM = ("am", "drop", "rank1")  # one AM fit gives all three


@dataclass(frozen=True, kw_only=True)
class CompactionSettings(ConfigIO):
    """Settings shared by every compaction method of an evaluation.

    Parameters
    ----------
    max_queries : int
        Reference queries per KV head (``CompactionConfig.max_queries``); >= 1.
    self_study_tokens : int
        Greedy tokens decoded after each self-study prompt during capture; >= 0.
    seed : int
        Seed of the query subsample; >= 0.
    """

    max_queries: int = 4096
    self_study_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("CompactionSettings", "max_queries", self.max_queries, 1)
        check_int("CompactionSettings", "self_study_tokens", self.self_study_tokens, 0)
        check_int("CompactionSettings", "seed", self.seed, 0)

    def config(self, method: str, ratio: float):
        from kvlocks.compaction.config import CompactionConfig

        return CompactionConfig(method=method, ratio=ratio, max_queries=self.max_queries, seed=self.seed)

    def reference(self):
        from kvlocks.integrations.hf.compaction.passes import ReferenceConfig

        return ReferenceConfig(self_study_tokens=self.self_study_tokens)


def source_of(method: str) -> str:
    """The compaction that is actually fitted for ``method``."""
    return "am" if method in DERIVED_FROM_AM else method


def derive(am_prefix, method: str):
    """``am``'s :class:`~kvlocks.compaction.prefix.CompactedPrefix` as ``method`` (am, drop, rank1)."""
    if am_prefix.method != "am":
        raise ValueError(f"derive needs an 'am' prefix, got {am_prefix.method!r}")
    if method == "am":
        return am_prefix
    cfg = am_prefix.config.replace(method=method)
    if method == "drop":
        return dataclasses.replace(am_prefix, beta=None, method="drop", config=cfg)
    if method == "rank1":  # keys [Hkv, t, D+1]: beta appended as coordinate D
        keys = tuple(torch.cat([k, b[..., None].to(k.dtype)], dim=-1) for k, b in zip(am_prefix.keys, am_prefix.beta))
        return dataclasses.replace(am_prefix, keys=keys, beta=None, method="rank1", config=cfg)
    raise ValueError(f"method={method!r}: only {DERIVED_FROM_AM} derive from an AM fit")


def _bare_reference():
    from kvlocks.integrations.hf.compaction.passes import ReferenceConfig

    return ReferenceConfig(repeat=False, self_study=())


class RecordCompactions:
    """The compacted prefixes of one record's context, each fitted at most once.

    Parameters
    ----------
    model, tokenizer
    prefix_ids : list of int
        The context to compact (T tokens).
    settings : CompactionSettings
    cache_dir : Path or None
        Where fitted prefixes are kept until :meth:`cleanup` (None: memory only).
    tag : str
        Identifies the record in file names (task, length, seed, index).
    progress : callable(str), optional
        Told what is being captured or compacted.
    """

    def __init__(self, model, tokenizer, prefix_ids: list[int], settings: CompactionSettings, *,
                 cache_dir: Path | None = None, tag: str = "record",
                 progress: Callable[[str], None] | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.ids = torch.tensor([prefix_ids], dtype=torch.int64)  # [1, T]
        self.settings, self.cache_dir, self.tag = settings, cache_dir, tag
        self.progress = progress or (lambda _msg: None)
        self._capture = None
        self._made: dict[tuple[str, float], object] = {}
        self._files: list[Path] = []

    def _path(self, source: str, ratio: float) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{self.tag}-{source}@{ratio:g}.safetensors"

    def capture(self, *, keep_all: bool = False):
        """The record's capture (made once). ``keep_all``: a fit that keeps every entry only
        needs the prefix K/V, so if no capture exists yet a bare prefill is recorded instead."""
        if self._capture is not None:
            return self._capture
        from kvlocks.integrations.hf.compaction.capture import capture_queries
        from kvlocks.integrations.hf.compaction.passes import reference_passes

        self.progress("prefilling" if keep_all else "capturing reference queries")
        passes = [] if keep_all else reference_passes(self.tokenizer, self.ids, self.settings.reference())
        cap = capture_queries(self.model, self.ids.to(self.model.device), passes,
                              max_queries=self.settings.max_queries, seed=self.settings.seed)
        if keep_all:
            return cap
        self._capture = cap
        return cap

    def _load(self, path: Path | None, config):
        if path is None or not path.exists():
            return None
        from kvlocks.compaction import cachefile

        try:
            prefix = cachefile.load(path, self.model)
        except ValueError as exc:
            log.warning("ignoring cached compaction %s: %s", path, exc)
            return None
        if prefix.config != config or prefix.reference != self.settings.reference().to_json() \
                or prefix.prefix_len != self.ids.shape[1]:
            log.warning("ignoring cached compaction %s: made with other settings", path)
            return None
        return prefix

    def _fit(self, source: str, ratio: float):
        key = (source, ratio)
        if key in self._made:
            return self._made[key]
        config = self.settings.config(source, ratio)
        path = self._path(source, ratio)
        prefix = self._load(path, config)
        if prefix is None:
            from kvlocks.integrations.hf.compaction.model import compact_capture

            keep_all = config.budget(self.ids.shape[1]) == self.ids.shape[1]
            capture = self.capture(keep_all=keep_all)
            self.progress(f"compacting {source}@{ratio:g}")
            # keep-all is exact without reference queries: record the passes that were really run
            reference = _bare_reference() if keep_all and capture is not self._capture else self.settings.reference()
            prefix = compact_capture(self.model, capture, config, reference=reference)
            if path is not None and prefix.kept < prefix.prefix_len:  # keep-all is instant: not saved
                from kvlocks.compaction import cachefile

                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp")
                cachefile.save(tmp, prefix)
                os.replace(tmp, path)  # never a half-written file under the final name
        if path is not None and path.exists():
            self._files.append(path)
        self._made[key] = prefix
        return prefix

    def get(self, method: str, ratio: float):
        """The :class:`~kvlocks.compaction.prefix.CompactedPrefix` of ``method`` at ``ratio``."""
        prefix = self._fit(source_of(method), ratio)
        return derive(prefix, method) if method in DERIVED_FROM_AM else prefix

    def cleanup(self) -> None:
        """Delete this record's saved fits (call once all its rows are written)."""
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files.clear()
        self._capture = None
        self._made.clear()


def compaction_stats(cache, prefix, elem_size: int) -> dict:
    """Bytes read per decode step and layer over a compacted cache, in DecodeStats' keys.

    Each step attends every stored entry: the t kept ones plus the tokens decoded so far (this
    one included), against T + those for ``full``. ``bias_bytes`` is the per-entry logit bias
    that ``am`` reads (``rank1``'s extra key coordinate, the same bytes).
    """
    m = prefix.model
    t, num = prefix.kept, prefix.prefix_len
    steps = cache.physical_length() - t
    mean_new = (steps + 1) / 2 if steps else 0.0  # tokens appended, averaged over steps 1..steps
    attended, context = t + mean_new, num + mean_new
    per_token = 2.0 * m.num_kv_heads * m.head_dim * elem_size  # K and V of one token, all KV heads
    bias = m.num_kv_heads * t * elem_size if prefix.has_bias else 0.0
    kv, full = per_token * attended, per_token * context
    return {"decode_steps": steps, "pages_selected": None, "tokens_attended": attended,
            "context_tokens": context, "selection_bytes": 0.0, "bias_bytes": bias, "kv_bytes": kv,
            "bytes_read": kv + bias, "full_bytes": full,
            "read_fraction": (kv + bias) / full if steps else None}


def compacted_selector_stats(cache, prefix, elem_size: int) -> dict:
    """Bytes read per decode step and layer by a selector over a compacted cache, against ``full``.

    The cache's own accounting (:class:`~kvlocks.integrations.hf.stats.DecodeStats`) counts what the
    selector read (its summaries and the selected pages of the t kept entries plus new tokens);
    ``full`` attends the uncompacted context instead: T + the tokens decoded so far.
    """
    s = cache.stats.summary()
    m = prefix.model
    steps = s["decode_steps"]
    mean_new = (steps + 1) / 2 if steps else 0.0
    full = 2.0 * m.num_kv_heads * m.head_dim * elem_size * (prefix.prefix_len + mean_new)
    return {**s, "context_tokens": prefix.prefix_len + mean_new, "full_bytes": full,
            "read_fraction": s["bytes_read"] / full if steps else None}
