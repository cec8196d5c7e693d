"""Random-weight decoders at real shapes, built directly on the device in the target dtype.

For speed benchmarks: decode time does not depend on the weights' values. Construction runs under
``torch.device(device)`` with ``_from_config(dtype=...)``, so parameters are allocated and
initialised on the GPU (a 9B model in about a second) instead of in float32 on the CPU.
"""

from __future__ import annotations

import torch

SHAPES = {
    # GLM-4-9B-Chat-1M: 40 layers, 32 query / 4 KV heads, D = 128, partial (half) interleaved RoPE,
    # q/k/v bias; rope_theta as 10000 * rope_ratio (rope_ratio 10000 in the 1M checkpoint)
    "glm4-9b-1m": ("glm", dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128, attention_bias=True,
                               rms_norm_eps=1.5625e-07, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 1.0e8,
                                                "partial_rotary_factor": 0.5})),
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads, D = 128, llama3 RoPE scaling
    "llama3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})),
}


def model_config(name: str, *, max_positions: int = 1 << 20, **overrides):
    """The transformers config of a shape in :data:`SHAPES` (``overrides`` change fields, e.g.
    ``num_hidden_layers=2`` for a small test model)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; allowed {sorted(SHAPES)}")
    kind, fields = SHAPES[name]
    fields = {**fields, "max_position_embeddings": max_positions, "pad_token_id": None, "eos_token_id": None,
              "bos_token_id": None, **overrides}
    if kind == "glm":
        from transformers import GlmConfig

        return GlmConfig(**fields)
    from transformers import LlamaConfig

    return LlamaConfig(**fields)


@torch.no_grad()
def random_model(config, *, dtype: torch.dtype = torch.bfloat16, device="cuda", seed: int = 0):
    """A ``*ForCausalLM`` with random weights for ``config``, allocated on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()
