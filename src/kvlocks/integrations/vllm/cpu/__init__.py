"""The LOCKS attention backend for vLLM on CPU and its summary store by physical block."""
