"""One projection launch instead of three: the q/k/v weights of a layer laid out in one matrix.

At batch 1 a decode step's q/k/v projections are matrix-vector products, and the k and v ones are
small (GLM-4-9B: 512 x 4096 each, 4 MB; Llama-3.1-8B: 1024 x 4096, 8 MB): each launch pays a fixed
start and drain, a large share of a 1-2 us read. :func:`fused_qkv` copies a layer's three weights
(and biases) into one ``[Nq + Nk + Nv, H]`` matrix once and points the modules' parameters at
views of it, so memory does not grow and the model's own forward still reads the same values;
the decode step then computes ``linear(h, W_qkv, b_qkv)`` and splits the result, which is the
three products column for column.
"""

from __future__ import annotations

import torch

_ATTR = "_kvlocks_qkv"  # on the attention module: (weight, bias or None, (Nq, Nk, Nv))


def _plain_linear(mod) -> bool:
    return type(mod) is torch.nn.Linear


def _still_views(mods, weight: torch.Tensor) -> bool:
    """Do the modules' weights still live in ``weight``'s storage? (Not after ``model.to(...)`` or a
    reassigned parameter: then the fused matrix is stale and is made again.)"""
    ptr = weight.untyped_storage().data_ptr()
    return all(m is not None and _plain_linear(m) and m.weight.untyped_storage().data_ptr() == ptr for m in mods)


def fused_qkv(attn) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, int]]:
    """``(W_qkv, b_qkv, sizes)`` of an attention module with ``q_proj``/``k_proj``/``v_proj``,
    made once (later calls return the same tensors while the modules' weights are still views of
    them; in-place updates such as ``load_state_dict`` keep them so). ValueError when the three are not plain
    ``nn.Linear`` layers of one dtype and device with the same input size, biased alike."""
    mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    done = getattr(attn, _ATTR, None)
    if done is not None and _still_views(mods, done[0]):
        return done
    if not all(m is not None and _plain_linear(m) for m in mods):
        raise ValueError(f"{type(attn).__name__}: q/k/v must be plain torch.nn.Linear layers to fuse them")
    ws = [m.weight for m in mods]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
        raise ValueError(f"{type(attn).__name__}: q/k/v weights differ in dtype, device or input size")
    biased = [m.bias is not None for m in mods]
    if any(biased) != all(biased):
        raise ValueError(f"{type(attn).__name__}: q/k/v must all have a bias or none")
    sizes = tuple(int(w.shape[0]) for w in ws)
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in ws], dim=0)
        bias = torch.cat([m.bias.detach() for m in mods], dim=0) if all(biased) else None
        at = 0
        for m, n in zip(mods, sizes):
            m.weight.data = weight[at : at + n]  # the module keeps its Parameter, now a view
            if bias is not None:
                m.bias.data = bias[at : at + n]
            at += n
    done = (weight, bias, sizes)
    setattr(attn, _ATTR, done)
    return done
