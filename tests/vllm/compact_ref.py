"""Make compacted-cache files and the Hugging Face path's greedy tokens after them (for the connector tests).

Usage: python compact_ref.py SPEC.json OUT.json. SPEC: {"dir": folder for the files, "docs": [{"name",
"text", "method", "t"}], "questions": [str], "max_tokens": int, optional "reference_dtype": the
dtype of the model that decodes after the files, "float32" (default) or "bfloat16" (what a bf16
server should match)}. For every document: compact it with kvlocks (float32 model), save
``dir/NAME.safetensors``; for every question: the HF path's greedy tokens with that file (``serve.open_cache`` + ``serve.generate``, dense SDPA), and the same
with new tokens at position t instead of T (what serving without re-rotation would give). Also
writes the hostile files the rejection tests use (see :func:`bad_files`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def bad_files(src: Path, out: Path) -> dict[str, str]:
    """The hostile and broken files of tests/hostile_files.py, and a loadable but biased (am) file."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared case table
    import hostile_files

    return hostile_files.write_cases(src, out, {**hostile_files.CASES, **hostile_files.SERVE_ONLY})


def run(spec: dict) -> dict:
    from kvlocks.integrations.hf.compaction import serve
    from kvlocks.integrations.hf import cache_kwargs
    from kvlocks.compaction.cachefile import save
    from kvlocks.compaction.config import CompactionConfig
    from kvlocks.integrations.hf.compaction.model import compact_prefix
    from kvlocks.integrations.hf.compaction.passes import ReferenceConfig
    from kvlocks.models import load

    torch.manual_seed(0)
    model, tok = load("smollm2-135m", dtype=torch.float32)
    dtype = spec.get("reference_dtype", "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"reference_dtype={dtype!r}: allowed 'float32' or 'bfloat16'")
    decoder = model if dtype == "float32" else load("smollm2-135m", dtype=getattr(torch, dtype))[0]
    out_dir = Path(spec["dir"])
    # few reference passes and queries: these tests check serving, not compaction quality (the
    # bias fit dominates: a fold of 70 of 325 keys with 128 queries took 83 s on 2 busy cores)
    reference = ReferenceConfig(repeat=False, self_study=("Summarise the text above.",), self_study_tokens=4)
    result = {"docs": {}, "hf": {}, "hf_shifted_at_t": {}, "questions": {}}
    for q in spec["questions"]:
        result["questions"][q] = tok(q, add_special_tokens=False).input_ids
    for doc in spec["docs"]:
        t0 = time.time()
        ids = tok(doc["text"], return_tensors="pt", add_special_tokens=False).input_ids  # [1, T]
        config = CompactionConfig(method=doc["method"], ratio=min(1.0, doc["t"] / ids.shape[1]), max_queries=128)
        prefix = compact_prefix(model, tok, ids, config, reference=reference, t=doc["t"], model_id="smollm2-135m")
        path = out_dir / f"{doc['name']}.safetensors"
        save(path, prefix)
        result["docs"][doc["name"]] = {"path": str(path), "T": prefix.prefix_len, "t": prefix.kept,
                                       "compact_s": time.time() - t0}
        for q, qids in result["questions"].items():
            key = f"{doc['name']}|{q}"
            new = torch.tensor([qids])
            with torch.no_grad():
                cache = serve.open_cache(decoder, path)
                gen = serve.generate(decoder, cache, new, max_new_tokens=spec["max_tokens"], do_sample=False)
                result["hf"][key] = gen[0].tolist()
                # new tokens at positions t.. with the keys not re-rotated: vLLM's positions, no connector fix
                naive = serve.open_cache(decoder, path)
                naive.position_offset = 0
                ids_t = torch.cat([torch.zeros(1, prefix.kept, dtype=torch.long), new], dim=1)  # [1, t + L]
                gen = decoder.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                                     max_new_tokens=spec["max_tokens"], **cache_kwargs(decoder, naive))
                result["hf_shifted_at_t"][key] = gen[0, ids_t.shape[1]:].tolist()
    first = out_dir / f"{spec['docs'][0]['name']}.safetensors"
    result["bad"] = bad_files(first, out_dir)
    result["vocab_size"] = model.config.vocab_size
    return result


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    json.dump(run(spec), open(sys.argv[2], "w"))
