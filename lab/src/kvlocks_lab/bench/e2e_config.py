"""What the end-to-end benchmark (:mod:`kvlocks_lab.bench.e2e`) measures: :class:`E2EBenchConfig`
and the columns of its rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kvlocks.config_io import ConfigIO, check_int
from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.engine.models import SHAPES

E2E_METHODS = ("dense", "locks", "locks_centroid")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROW_KEYS = ("model", "context", "batch", "method", "budget", "kernel", "compile_mode", "tpot_ms", "tpot_mean_ms",
            "tpot_max_ms", "ttft_ms", "ttft_note",
            "build_ms", "build_exposed_ms", "ready_ms", "bytes_per_step", "weight_bytes", "kv_bytes", "summary_bytes", "floor_ms",
            "tpot_over_floor", "speedup_vs_dense", "gpu_mem_gb", "gpu_peak_gb", "fill", "steps")


@dataclass(frozen=True, kw_only=True)
class E2EBenchConfig(ConfigIO):
    """What to measure. Batch 1 at every context, then every batch of ``batches`` at
    ``batch_context``. ``model_overrides`` changes config fields of every model (tiny test runs)."""

    models: tuple[str, ...] = ("glm4-9b-1m", "llama3.1-8b")
    contexts: tuple[int, ...] = (16384, 32768, 65536, 131072, 262144, 524288, 1048576)  # 32K: the crossover target
    batches: tuple[int, ...] = (1, 2, 3, 4)
    batch_context: int = 262144
    methods: tuple[str, ...] = ("dense", "locks")  # also "locks_centroid": centroids choose the re-rank's candidates
    budget: int = 2048
    centroid_rerank: int = 8  # locks_centroid: candidates = max(centroid_rerank * (k - 2), centroid_min) pages
    centroid_min: int = 256
    steps: int = 48
    warmup: int = 4
    max_prefill: int = 131072
    ttft_repeats: int = 3  # real prefills per method and case, dense and LOCKS alternating: median
    prefill_chunk: int = 8192
    reserve_gib: float = 3.0
    dtype: str = "bfloat16"
    compile: bool = True  # torch.compile of the step's per-layer pieces, dense and LOCKS alike
    seed: int = 0
    model_overrides: dict = field(default_factory=dict)
    kernels: KernelOptions = field(default_factory=KernelOptions)  # how the decode kernels launch
    # Every case compiles the step's pieces for its own shapes (batch; the caches' rows are dynamic), all
    # in one process. Past Dynamo's recompile limit (8 by default) a piece would silently run eagerly and
    # its rows would be slow for a reason the table does not show (seen on the H200: two rows 7-20% slow).
    # The bench raises the limit to this and makes reaching it an error of that case instead.
    recompile_limit: int = 64

    def centroid_config(self, base: LocksConfig) -> LocksConfig:
        """``base`` with the locks_centroid candidates (``rerank_scores="centroid"``)."""
        return dataclasses.replace(base, rerank=self.centroid_rerank, rerank_min=self.centroid_min,
                                   rerank_scores="centroid")

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):  # from_json
            object.__setattr__(self, "kernels", KernelOptions(**self.kernels))
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"E2EBenchConfig.kernels must be a KernelOptions, got {type(self.kernels).__name__}")
        check_int("E2EBenchConfig", "recompile_limit", self.recompile_limit, 1)
        for m in self.models:
            if m not in SHAPES:
                raise ValueError(f"E2EBenchConfig.models: {m!r} not in {tuple(SHAPES)}")
        for m in self.methods:
            if m not in E2E_METHODS:
                raise ValueError(f"E2EBenchConfig.methods: {m!r} not in {E2E_METHODS}")
        self.centroid_config(LocksConfig(budget=self.budget))  # validates the budget and the candidates
        for n in (*self.contexts, self.batch_context):
            check_int("E2EBenchConfig", "contexts", n, 16)
        for b in self.batches:
            check_int("E2EBenchConfig", "batches", b, 1, 256)
        check_int("E2EBenchConfig", "steps", self.steps, 3)
        check_int("E2EBenchConfig", "warmup", self.warmup, 0)
        if self.compile not in (True, False):
            raise ValueError(f"E2EBenchConfig.compile={self.compile!r}: allowed True or False")
        check_int("E2EBenchConfig", "max_prefill", self.max_prefill, 0)
        check_int("E2EBenchConfig", "ttft_repeats", self.ttft_repeats, 1, 100)
        check_int("E2EBenchConfig", "prefill_chunk", self.prefill_chunk, 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"E2EBenchConfig.dtype={self.dtype!r}: allowed {tuple(DTYPES)}")

    def cases(self) -> list[tuple[int, int]]:
        """(context, batch) pairs in run order: batch 1 by context, then the batch sweep."""
        out = [(n, 1) for n in self.contexts]
        out += [(self.batch_context, b) for b in self.batches if (self.batch_context, b) not in out]
        return out
