"""The LOCKS attention backend for vLLM on CPU (:mod:`.backend`) and its summary store by physical
block (:mod:`.store`). Importing this package imports nothing from vLLM."""
