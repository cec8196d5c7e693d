"""Tiny random-weight checkpoints of the layer kinds LOCKS meets in served models, written with
transformers (the GPU machine's) for vLLM to load from disk: a Gemma-3-like hybrid (sliding-window
layers around global ones, head_dim 256) and a gpt-oss-like model (alternating 128-token windows,
learned per-head sinks set large enough to matter, head_dim 64). transformers' own initialisation
(normal, std 0.02) gives non-degenerate attention, unlike vLLM's ``load_format="dummy"`` (weights in
±1e-3). No tokenizer: the engines take prompt token ids (``skip_tokenizer_init``); the weights are saved in
``dtype`` (bfloat16 by default: the GPU engines run in bfloat16, ``gpu_helpers.BASE_LLM``; the CPU
tests use float32)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 4096


def gemma3_like(out: Path, *, layers: int = 12, window: int = 128,
                dtype: torch.dtype = torch.bfloat16) -> tuple[Path, list[int]]:
    """Five sliding-window layers then one global, repeated; returns (dir, global layer numbers)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=window,
                           layer_types=types, max_position_embeddings=8192, query_pre_attn_scalar=256)
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(dtype).save_pretrained(out)
    return out, [i for i, t in enumerate(types) if t == "full_attention"]


def gpt_oss_like(out: Path, *, layers: int = 4, experts_per_token: int = 4) -> Path:
    """Alternating sliding (even layers, 128 tokens) and global layers with learned sinks; every token
    routed to ``experts_per_token`` of the 4 experts (default all of them). With top-2 routing, bf16-level differences between two exact attention
    kernels flip near-tied expert choices of these random weights (FLASH_ATTN and LOCKS then part at
    step 16 of a 2,300-token prompt; with every expert routed both give the same 24 tokens on every
    prompt: docs/results/2026-12-06-h100-vllm-serving/, scripts/gpu/probes/sinks_engines.py), which
    would test the router instead of the sinks."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=4,
                       num_experts_per_tok=experts_per_token, sliding_window=128, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):  # ~ the log of a few hundred tokens' mass: the sink takes a visible share
            p.data.copy_(torch.rand(p.shape, generator=g) * 4 + 3)
    model.to(torch.bfloat16).save_pretrained(out)
    return out
