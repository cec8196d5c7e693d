"""A GPU decode engine for whole Hugging Face decoders on the paged LOCKS cache (docs/engine.md).

Modules, one concept each: ``config`` (EngineConfig), ``parts`` (the model's own submodules),
``cache`` (static paged cache for all layers), ``prefill`` (dense, chunked), ``attention``
(locks / dense decode attention), ``step`` (one static-shape decode step), ``graph`` (CUDA-graph
capture and replay), ``engine`` (DecodeEngine: prefill, build, decode), ``models`` (random-weight
models at real shapes, built on the device).
"""

from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.config import EngineConfig
from kvlocks.engine.engine import DecodeEngine
from kvlocks.engine.graph import StepRunner
from kvlocks.engine.parts import ModelParts, model_parts
from kvlocks.engine.prefill import prefill
from kvlocks.engine.step import DecodeStep

__all__ = ["DecodeEngine", "DecodeStep", "EngineConfig", "ModelParts", "StaticPagedCache", "StepRunner",
           "model_parts", "prefill"]
