"""The Hugging Face path's greedy tokens after a compacted-cache file, on the GPU (bf16), for the
connector test. Usage: python connector_ref.py SPEC.json OUT.json. SPEC: {"files": {name: path},
"questions": {text: ids}, "max_tokens": int, "dtype": "bfloat16"}. OUT: {"hf": {"name|text": ids}}."""

import json
import sys

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    import torch

    from kvlocks.compaction import serve
    from kvlocks.models import load

    model, _ = load("smollm2-135m", dtype=getattr(torch, spec.get("dtype", "bfloat16")), device="cuda")
    out = {}
    for name, path in spec["files"].items():
        for text, qids in spec["questions"].items():
            with torch.no_grad():
                cache = serve.open_cache(model, path)
                gen = serve.generate(model, cache, torch.tensor([qids]), max_new_tokens=spec["max_tokens"],
                                     do_sample=False)
            out[f"{name}|{text}"] = gen[0].tolist()
    json.dump({"hf": out}, open(sys.argv[2], "w"))
