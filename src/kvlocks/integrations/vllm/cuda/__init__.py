"""The LOCKS attention backend for vLLM on CUDA: its step, summary store and vLLM internals."""
