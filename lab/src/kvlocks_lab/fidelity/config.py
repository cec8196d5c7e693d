"""``FidelityConfig``: what one ``kvlocks fidelity`` run measures (frozen, validated).

The defaults are sized to run end to end on the bundled model on a 2-core CPU in well under
30 minutes (see ``docs/fidelity.md`` for the measured wall time): 2 records of each of 3 needle
tasks and 1 natural text, 4096 tokens each, every layer and KV head, the last 32 teacher-forced
query positions of each prompt, 5 budgets and 17 selector variants.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlocks.config_io import ConfigIO, check_int

DEFAULT_TASKS = ("niah_single_text", "niah_multikey", "passkey")
DEFAULT_BUDGETS = (48, 64, 128, 256, 512)


def _default_selectors() -> tuple[str, ...]:
    from kvlocks_lab.fidelity.variants import DEFAULT_VARIANTS

    return DEFAULT_VARIANTS


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    check_int("FidelityConfig", name, value, low, high)


def _check_ints(name: str, values, low: int) -> None:
    if not isinstance(values, tuple):
        raise ValueError(f"FidelityConfig.{name}={values!r}: must be a tuple of integers")
    for v in values:
        _check_int(name, v, low)
    if len(set(values)) != len(values):
        raise ValueError(f"FidelityConfig.{name}={values!r}: has duplicates")


@dataclass(frozen=True, kw_only=True)
class FidelityConfig(ConfigIO):
    """One fidelity run.

    Parameters
    ----------
    model : bundled model name or local Hugging Face directory
    tasks : needle tasks of :data:`kvlocks_lab.eval.tasks.TASKS` (each must plant a numeric needle)
    samples : records per task
    text_records : prompts of plain natural prose (no needle), continuation = the next tokens
    length : target prompt length in tokens (needle prompts: context + question + answer)
    queries : Q, decode-time query positions captured per prompt (the last Q of the prompt)
    budgets : tokens attended per layer and KV head, multiples of ``page_size``, >= 2 pages
    selectors : variant names (:data:`kvlocks_lab.fidelity.variants.DEFAULT_VARIANTS` and the
        pattern ``locks_r<R>_b<bits>``)
    layers, kv_heads : indices to measure; empty = all
    page_size, rank : S and R of the LOCKS summaries (and of the scope ladder)
    calib_tokens : tokens of calibration prose for Loki and the global basis; disjoint from
        every evaluated prompt (checked sentence by sentence); 0: none (long prompts can use up
        the prose), which the selectors fitted on it refuse
    hot_share : a (query head, step) counts as carrier-attending when the carrier pages hold at
        least this exact share of its mass; ``carrier_hot`` is measured on those only
    kendall_stride : Kendall tau on every ``kendall_stride``-th query step (scipy's loop is the
        slowest metric; Spearman is computed on every step)
    scatter_pages : pages per (layer, KV head) sampled for the exact-vs-estimated share figure
    seed : seeds the records, the text offsets, the random selector and the samples
    dtype, device : model precision and device
    """

    model: str = "smollm2-135m"
    tasks: tuple[str, ...] = DEFAULT_TASKS
    samples: int = 2
    text_records: int = 1
    length: int = 4096
    queries: int = 32
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    selectors: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    page_size: int = 16
    rank: int = 8
    calib_tokens: int = 2048
    hot_share: float = 0.05
    kendall_stride: int = 4
    scatter_pages: int = 24
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        from kvlocks_lab.eval.tasks import TASKS
        from kvlocks_lab.fidelity.variants import check_variant, variant

        if not self.selectors:
            object.__setattr__(self, "selectors", _default_selectors())
        if not isinstance(self.tasks, tuple):
            raise ValueError(f"FidelityConfig.tasks={self.tasks!r}: must be a tuple of task names")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"FidelityConfig.tasks: unknown task {t!r}; allowed {sorted(TASKS)}")
        _check_int("samples", self.samples, 0)
        _check_int("text_records", self.text_records, 0)
        if self.samples * len(self.tasks) + self.text_records < 1:
            raise ValueError("FidelityConfig: no prompts (samples * len(tasks) + text_records must be >= 1)")
        _check_int("page_size", self.page_size, 2, 4096)
        _check_int("rank", self.rank, 1, self.page_size)
        _check_int("length", self.length, 256)
        _check_int("queries", self.queries, 1, 512)
        if self.calib_tokens:  # 0: no calibration prose (long prompts may leave no prose disjoint from them)
            _check_int("calib_tokens", self.calib_tokens, self.page_size)
        else:
            _check_int("calib_tokens", self.calib_tokens, 0)
        _check_int("kendall_stride", self.kendall_stride, 1)
        _check_int("scatter_pages", self.scatter_pages, 0)
        _check_int("seed", self.seed, 0)
        _check_ints("budgets", self.budgets, 1)
        if not self.budgets:
            raise ValueError("FidelityConfig.budgets: at least one budget is required")
        for b in self.budgets:
            if b % self.page_size or b < 2 * self.page_size:
                raise ValueError(f"FidelityConfig.budgets: {b} must be a multiple of page_size={self.page_size} "
                                 f"and cover >= 2 pages (sink + recent), i.e. >= {2 * self.page_size}")
        _check_ints("layers", self.layers, 0)
        _check_ints("kv_heads", self.kv_heads, 0)
        if not isinstance(self.selectors, tuple) or len(set(self.selectors)) != len(self.selectors):
            raise ValueError(f"FidelityConfig.selectors={self.selectors!r}: must be a tuple of distinct names")
        for s in self.selectors:
            check_variant(s)
        need = [n for n in self.selectors if variant(n).needs_calibration]
        if not self.calib_tokens and need:
            raise ValueError(f"FidelityConfig.calib_tokens=0: selectors {need} are fitted on calibration prose; "
                             f"drop them or give calib_tokens >= page_size ({self.page_size})")
        if not isinstance(self.hot_share, (int, float)) or not 0.0 < float(self.hot_share) <= 1.0:
            raise ValueError(f"FidelityConfig.hot_share={self.hot_share!r}: must be in (0, 1]")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"FidelityConfig.dtype={self.dtype!r}: allowed ('float32', 'bfloat16', 'float16')")
