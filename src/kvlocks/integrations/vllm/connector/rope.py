"""Re-rotate post-RoPE keys by a constant position shift, with the model's own rotary code.

Why. A compacted prefix stands for T tokens but holds t entries whose keys keep the RoPE phase of
their original positions p; in the Hugging Face path new tokens continue at position T. vLLM
derives positions from the token count, so the connector's request has only t placeholder tokens
and new tokens sit at t, t+1, ... Rotating every kept key once by ``-(T - t)`` restores the
relative positions exactly: RoPE logits depend on the query and key positions only through their
difference, ``<R(a) q, R(b) k> = <q, R(b - a) k>``, and ``R(-s) R(p) = R(p - s)``, so a query at
``t + i`` against a key moved to ``p - (T - t)`` sees the offset ``T + i - p`` it sees in the HF path.

This holds for every RoPE whose rotation angle is ``position * inv_freq`` with a fixed
``inv_freq`` (``default``, ``linear``, ``llama3``, ``yarn``); a scaling factor that multiplies cos
and sin (yarn's attention factor) is already in the stored keys and in vLLM's queries, so the
shift is a pure rotation. Types whose frequencies depend on the sequence length (``dynamic``,
``longrope``) or anything unknown are refused: the shift would not be exact.

The frequencies come from transformers' rotary embedding class of the model family (its
``inv_freq``, from the config's ``rope_parameters``) and the rotation uses that family's
``rotate_half`` (the neox / rotate-half pairing that vLLM also uses for these families); only the
angle ``-shift * inv_freq`` is computed here, in float64.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

# model_type -> transformers class prefix; all pair dimension j with j + D/2 (rotate_half)
ROTARY_FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
SHIFTABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeShiftError(ValueError):
    """The model's RoPE cannot be shifted exactly by a constant (type or family unsupported)."""


@dataclass(frozen=True)
class KeyShifter:
    """Rotates keys ``[..., D]`` by ``-shift`` positions.

    Attributes
    ----------
    inv_freq : Tensor [D/2], float64
        The rotary frequencies from transformers' rotary class of the family.
    rotate_half : callable
        The family's ``rotate_half`` (``[x1, x2] -> [-x2, x1]``).
    rope_type : str
    """

    inv_freq: torch.Tensor
    rotate_half: Callable[[torch.Tensor], torch.Tensor]
    rope_type: str

    def shift(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """Keys rotated from position p to p - ``shift``.

        Parameters
        ----------
        keys : Tensor [..., D], any float dtype
            Post-RoPE keys.
        shift : int
            T - t (0 returns the keys unchanged, as float64).

        Returns
        -------
        Tensor [..., D], float64
        """
        d = keys.shape[-1]
        if 2 * self.inv_freq.numel() != d:
            raise RopeShiftError(f"keys have head dim {d} but the rotary has {2 * self.inv_freq.numel()} "
                                 "dimensions (partial rotary is not supported)")
        k = keys.to(torch.float64)
        if shift == 0:
            return k
        angle = -float(shift) * self.inv_freq  # [D/2], float64
        emb = torch.cat([angle, angle])  # [D], the rotate_half layout
        return k * emb.cos() + self.rotate_half(k) * emb.sin()


def key_shifter(hf_config) -> KeyShifter:
    """The :class:`KeyShifter` of a transformers config, or :class:`RopeShiftError`.

    Parameters
    ----------
    hf_config : transformers ``PretrainedConfig`` of a decoder (the text config is used).
    """
    cfg = hf_config.get_text_config(decoder=True) if hasattr(hf_config, "get_text_config") else hf_config
    family = getattr(cfg, "model_type", None)
    if family not in ROTARY_FAMILIES:
        raise RopeShiftError(f"model_type {family!r}: re-rotating keys is supported for "
                             f"{sorted(ROTARY_FAMILIES)} (rotate-half RoPE)")
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SHIFTABLE_ROPE_TYPES:
        raise RopeShiftError(f"rope_type {rope_type!r}: a constant position shift is exact only for "
                             f"{SHIFTABLE_ROPE_TYPES} (frequencies independent of sequence length)")
    if float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise RopeShiftError("partial_rotary_factor != 1 is not supported")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_cls = getattr(module, f"{ROTARY_FAMILIES[family]}RotaryEmbedding")
    rotary = rotary_cls(config=cfg)
    if getattr(rotary, "rope_type", rope_type) != rope_type:
        raise RopeShiftError(f"transformers resolved rope_type {rotary.rope_type!r}, config says {rope_type!r}")
    return KeyShifter(inv_freq=rotary.inv_freq.detach().to("cpu", torch.float64),
                      rotate_half=module.rotate_half, rope_type=rope_type)
