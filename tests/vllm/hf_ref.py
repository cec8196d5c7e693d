"""The Hugging Face path's greedy tokens and selected pages, for comparison with the vLLM backend.

Run as a script (``python hf_ref.py SPEC.json OUT.json``) or call :func:`run`. It records, for
each decode step and layer, the pages :func:`kvlocks.selection.choose_pages` returned inside
:class:`kvlocks.integrations.hf.cache.LocksLayer` (wrapped for the duration of the call only).
SPEC: ``prompt_ids``, ``locks`` (LocksConfig JSON, or null for full attention), ``max_tokens``,
``dtype`` (default float32) and ``model`` (a checkpoint directory; default the bundled model).
"""

from __future__ import annotations

import json
import sys

import torch


def _model(model: str | None, dtype: torch.dtype):
    """The bundled model, or a checkpoint directory without a tokenizer (``tiny_models.py``) loaded
    as :func:`kvlocks.models.load` loads one."""
    if model is None:
        from kvlocks.models import load

        return load("smollm2-135m", dtype=dtype)[0]
    from transformers import AutoModelForCausalLM

    from kvlocks.integrations.hf import ATTN_NAME, register

    register()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=ATTN_NAME,
                                                local_files_only=True).eval()


def run(prompt_ids: list[int], locks_json: str | None, max_tokens: int, dtype: str = "float32",
        model: str | None = None) -> dict:
    import kvlocks.integrations.hf.cache as hf
    from kvlocks.integrations.hf import cache_kwargs
    from kvlocks.config import LocksConfig

    model = _model(model, getattr(torch, dtype))
    config = LocksConfig.from_json(locks_json) if locks_json else LocksConfig()
    # backend="torch": the references' choose_pages on every step (the spy below records it)
    cache = hf.LocksCache(model.config, method="locks" if locks_json else "full", config=config, backend="torch")
    records: list[dict] = []
    real = hf.choose_pages

    def spy(q, view, cfg, selector):
        pages = real(q, view, cfg, selector)  # [B=1, Hkv, K]
        records.append({"layer": view.layer, "seq_len": int(view.keys.shape[-2]), "pages": pages[0].tolist()})
        return pages

    hf.choose_pages = spy
    try:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, **cache_kwargs(model, cache))
    finally:
        hf.choose_pages = real
    if locks_json and not records:
        raise AssertionError("the HF reference recorded no selected pages: choose_pages was not called")
    return {"tokens": out[0, len(prompt_ids):].tolist(), "records": records}


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    res = run(spec["prompt_ids"], spec.get("locks"), spec["max_tokens"], spec.get("dtype", "float32"),
              spec.get("model"))
    json.dump(res, open(sys.argv[2], "w"))
