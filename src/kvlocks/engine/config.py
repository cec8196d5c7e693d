"""EngineConfig: what the GPU decode engine runs (method, budget, batch, capacity, backend, kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlocks.config_io import ConfigIO, check_int
from kvlocks.config import KernelOptions, LocksConfig
from kvlocks.kernels_support import BACKENDS, check_config
from kvlocks.pages import num_pages

METHODS = ("locks", "dense", "auto")
# auto: where LOCKS starts to decode faster than dense, as the K/V bytes one sequence holds per layer.
# On the H200 (budget 2048, against the tuned dense launch, both with programmatic dependent launch)
# GLM-4-9B (4 KV heads, 2 KB per token and layer in bf16) is 1.00x at 32K and 1.07x at 64K (1.0 at
# ~33K tokens, ~68 MB); Llama-3.1-8B (8 KV heads, 4 KB) 0.96x at 16K, 1.05x at 32K (1.0 at ~22K,
# ~90 MB). 80 MB, between the two, is within ~1-2% of both. Below it dense's one attention kernel
# beats LOCKS's three dependent ones; above it the K/V read dominates (docs/benchmarks.md, "Targets").
AUTO_CROSSOVER_KV_BYTES = 80_000_000


@dataclass(frozen=True, kw_only=True)
class EngineConfig(ConfigIO):
    """Configuration of one :class:`~kvlocks.engine.engine.DecodeEngine`.

    Parameters
    ----------
    method : ``"locks"`` (score summaries, select ``budget`` tokens per layer and KV head, attend
        those), ``"dense"`` (attend every token: the split-KV kernel over all pages on CUDA) or
        ``"auto"``: dense while the context is shorter than ``auto_min_context`` tokens (where dense
        is as fast or faster), LOCKS from there on: chosen at each prefill by the prompt's length,
        and a dense decode switches to LOCKS at the step whose context reaches the threshold
        (every full page's summaries are built then, once); summaries are built only for LOCKS
    auto_min_context : (auto) the context length from which LOCKS is used; None (default): from the
        model's shape, the length at which one sequence's K/V per layer reaches
        ``AUTO_CROSSOVER_KV_BYTES`` (:func:`auto_min_context_for`; measured on the H200 at budget
        2048: ~39K tokens for GLM-4-9B, ~19.5K for Llama-3.1-8B in bf16); other GPUs differ
    locks : LocksConfig (page size, budget, summary settings; int4 basis / int8 coefficients)
    batch : B, sequences decoded together (prompts of equal length, no padding)
    max_context : tokens per sequence the static cache holds (prompt + generated)
    prefill_chunk : tokens per chunk of the prefill's projections and MLP (memory, not numerics)
    backend : ``"triton"``, ``"torch"`` or None (Triton on CUDA, the PyTorch references otherwise)
    cuda_graph : capture the decode step in one CUDA graph; None = whenever the backend is Triton
    overlap_build : (locks) build each layer's summaries on a side CUDA stream while the prefill
        runs the next layers (:mod:`kvlocks.engine.overlap`); False builds each in line, on the prefill's stream
    compile : run the decode step's per-layer pieces around the attention through ``torch.compile``
        (:class:`~kvlocks.engine.step.DecodeStep`); the first step compiles them (on a GPU at batch 1 in
        Inductor's max-autotune mode, which times GEMM candidates for each weight product: a longer
        first compile for 0.1-0.4 ms less per step on the H200)
    tune_attention : (Triton on CUDA) at a method's first decode step, time the split-KV attention
        kernel's candidate launches on the cache (dense: over every page; LOCKS: over a budget of
        scattered pages) and keep the fastest (:mod:`kvlocks.attention.tune`; a few ms plus one
        compile per launch shape, once). The launches sum in different orders, so tokens may differ
        from an untuned run's at the level of float rounding; False keeps the default launch
    kernels : KernelOptions (programmatic dependent launch, the compile mode's batch limit, the
        attention launches the tuner times, the score kernel, the build solver)
    """

    method: str = "locks"
    locks: LocksConfig = field(default_factory=LocksConfig)
    batch: int = 1
    max_context: int = 4096
    prefill_chunk: int = 4096
    backend: str | None = None
    cuda_graph: bool | None = None
    overlap_build: bool = True
    compile: bool = False
    auto_min_context: int | None = None
    tune_attention: bool = True
    kernels: KernelOptions = field(default_factory=KernelOptions)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"EngineConfig.method={self.method!r}: allowed {METHODS}")
        if isinstance(self.locks, dict):  # from_json
            object.__setattr__(self, "locks", LocksConfig(**self.locks))
        if not isinstance(self.locks, LocksConfig):
            raise ValueError(f"EngineConfig.locks must be a LocksConfig, got {type(self.locks).__name__}")
        if isinstance(self.kernels, dict):  # from_json
            object.__setattr__(self, "kernels", KernelOptions(**self.kernels))
        if not isinstance(self.kernels, KernelOptions):
            raise ValueError(f"EngineConfig.kernels must be a KernelOptions, got {type(self.kernels).__name__}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend={self.backend!r}: allowed {BACKENDS} or None")
        # the head_dim is the model's: the engine checks it with the backend it resolves
        check_config(self.locks, None, backend=self.backend or "torch", owner="EngineConfig.locks")
        check_int("EngineConfig", "batch", self.batch, 1, 4096)
        check_int("EngineConfig", "max_context", self.max_context, 2, 1 << 26)
        check_int("EngineConfig", "prefill_chunk", self.prefill_chunk, 1)
        if self.auto_min_context is not None:
            check_int("EngineConfig", "auto_min_context", self.auto_min_context, 0)
        if self.tune_attention not in (True, False):
            raise ValueError(f"EngineConfig.tune_attention={self.tune_attention!r}: allowed True or False")
        if self.cuda_graph not in (None, True, False):
            raise ValueError(f"EngineConfig.cuda_graph={self.cuda_graph!r}: allowed True, False or None")
        for name in ("overlap_build", "compile"):
            if getattr(self, name) not in (True, False):
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r}: allowed True or False")


def auto_min_context_for(num_kv_heads: int, head_dim: int, element_bytes: int, page_size: int) -> int:
    """The ``auto`` threshold for a model shape: the first whole page at which one sequence's K and
    V per layer (``2 * num_kv_heads * head_dim * element_bytes`` bytes per token) reach
    ``AUTO_CROSSOVER_KV_BYTES``."""
    for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("element_bytes", element_bytes),
                    ("page_size", page_size)):
        check_int("auto_min_context_for", name, v, 1)
    per_token = 2 * num_kv_heads * head_dim * element_bytes
    tokens = -(-AUTO_CROSSOVER_KV_BYTES // per_token)
    return num_pages(tokens, page_size) * page_size
