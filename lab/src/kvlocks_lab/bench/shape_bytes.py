"""Bytes of a model shape from its Hugging Face ``config.json`` (a dict): bf16 weights, K/V per
context token, K/V a request's sliding-window layers hold. What ``vllm_tpot`` sizes its cells by."""

from __future__ import annotations


def window_layers(cfg: dict) -> int:
    """Layers whose keys are bounded by a sliding window (``layer_types``; none in a dense model)."""
    return sum(t == "sliding_attention" for t in cfg.get("layer_types") or [])


def kv_bytes_per_token(cfg: dict) -> int:
    """K and V bytes (bf16) per context token: the global layers' (a window layer holds at most its
    window per request, :func:`kv_bytes_per_request`)."""
    layers = cfg["num_hidden_layers"] - window_layers(cfg)
    return layers * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 2


def kv_bytes_per_request(cfg: dict) -> int:
    """K and V bytes (bf16) of one request's window layers: the window and one 16-token block."""
    return window_layers(cfg) * ((cfg.get("sliding_window") or 0) + 16) * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def weight_bytes(cfg: dict) -> int:
    """bf16 weight bytes: attention and gated MLP (times the experts of a mixture) per layer, the
    embeddings (once when tied)."""
    h, i, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    experts = cfg.get("num_local_experts") or 1
    per_layer = h * (q + 2 * kv) + q * h + experts * 3 * h * i
    return 2 * (layers * per_layer + (1 if cfg.get("tie_word_embeddings") else 2) * v * h)
