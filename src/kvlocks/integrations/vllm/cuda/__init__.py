"""The LOCKS attention backend for vLLM on CUDA (:mod:`.backend`): one step's plans and decode
paths (:mod:`.step`), the summary store beside the FlashAttention paged cache (:mod:`.store`) and
the vLLM internals it reads (:mod:`.compat`). Importing this package imports nothing from vLLM."""
