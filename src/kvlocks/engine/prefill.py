"""Dense prefill into the static paged cache: layer by layer, projections and MLP in chunks.

Per layer: the input norm, q/k/v projections and the model's RoPE run on ``chunk`` tokens at a
time, writing post-RoPE K/V straight into the layer's pages and Q into one buffer; then one causal
``scaled_dot_product_attention`` over the whole prompt (FlashAttention on CUDA in bf16/fp16, with
``enable_gqa``: the same kernel a stock Hugging Face SDPA prefill runs), then ``o_proj`` and the
MLP in chunks again. Peak activation memory is a few ``[B, T, hidden]`` buffers plus one chunk's
MLP, so long prompts fit; the arithmetic is the model's own, so the time to first token is that
of a dense prefill. Only the last position's logits are computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvlocks.engine.cache import StaticPagedCache
from kvlocks.engine.parts import ModelParts, finish_layer, project_qkv


def prefill_bytes(parts: ModelParts, batch: int, tokens: int, chunk: int, intermediate: int) -> int:
    """Activation bytes :func:`prefill` needs at most (hidden, Q and attention output buffers,
    one chunk's MLP, the attention's output), for the memory check before a benchmark case."""
    elem = torch.empty(0, dtype=parts.dtype).element_size()
    hidden = parts.embed.weight.shape[1]
    big = batch * tokens * (hidden + 2 * parts.num_q_heads * parts.head_dim) * elem
    return big + 4 * batch * min(chunk, tokens) * intermediate * elem


@torch.no_grad()
def prefill(parts: ModelParts, cache: StaticPagedCache, input_ids: torch.Tensor, *, chunk: int = 4096,
            after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
    """Run the prompt ``input_ids [B, T]`` (int64, no padding) and fill the cache's first T tokens.

    Returns the logits of the last position, ``[B, V]`` in the model's dtype. Sets the cache
    length to T. ``after_layer(l)`` is called as soon as layer ``l``'s K/V are written, before its
    attention (the engine queues that layer's summary build there: :mod:`kvlocks.engine.overlap`).
    """
    bsz, t = input_ids.shape
    if bsz != cache.batch:
        raise ValueError(f"input_ids has batch {bsz}, the cache was allocated for {cache.batch}")
    if not 1 <= t < cache.capacity:
        raise ValueError(f"prompt of {t} tokens: must be >= 1 and < the cache capacity {cache.capacity}")
    hq, d = parts.num_q_heads, parts.head_dim
    x = parts.embed(input_ids.to(parts.device))  # [B, T, H]
    pos = torch.arange(t, device=x.device).unsqueeze(0).expand(bsz, t)
    q_buf = torch.empty(bsz, t, hq, d, dtype=x.dtype, device=x.device)  # [B, T, Hq, D]
    spans = [slice(a, min(a + chunk, t)) for a in range(0, t, chunk)]
    for li, layer in enumerate(parts.layers):
        kv_k, kv_v = cache.token_view(li)  # [B, capacity, Hkv, D]
        for c in spans:
            cos, sin = parts.rotary(x[:, c], pos[:, c])
            q, k, v = project_qkv(parts, layer, x[:, c], cos, sin)  # [B, H, L, D]
            q_buf[:, c] = q.transpose(1, 2)
            kv_k[:, c] = k.transpose(1, 2)
            kv_v[:, c] = v.transpose(1, 2)
        if after_layer is not None:
            after_layer(li)
        out = F.scaled_dot_product_attention(
            q_buf.transpose(1, 2), kv_k[:, :t].transpose(1, 2), kv_v[:, :t].transpose(1, 2),
            is_causal=True, scale=parts.scale, enable_gqa=parts.group > 1,
        )  # [B, Hq, T, D]
        out = out.transpose(1, 2)  # [B, T, Hq, D]
        for c in spans:
            x[:, c] = finish_layer(layer, x[:, c], out[:, c].reshape(bsz, c.stop - c.start, hq * d))
        del out
    cache.set_length(t)
    return parts.lm_head(parts.norm(x[:, -1:]))[:, 0]
