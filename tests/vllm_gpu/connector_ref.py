"""The Hugging Face path after a compacted-cache file, on the GPU, for the connector test.

Usage: python connector_ref.py SPEC.json OUT.json. SPEC: {"files": {name: path}, "questions":
{text: ids}, "max_tokens": int, "dtype": "float32", "device": "cuda", "check": {id: {"file": path, "new": ids,
"tokens": ids}}}. OUT: {"hf": {"name|text": greedy ids}, "check": {id: {"argmax": [...],
"margin": [...]}}}: for each ``check`` entry, the HF path teacher-forced on its tokens after the
file and ``new``: at every step the HF path's own greedy token and how far (in logits) the given
token's logit is below the best one (0 where they agree)."""

import json
import sys

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    import torch

    from kvlocks.integrations.hf.compaction import serve
    from kvlocks.integrations.hf import cache_kwargs
    from kvlocks.models import load

    dev = spec.get("device", "cuda")
    model, _ = load("smollm2-135m", dtype=getattr(torch, spec.get("dtype", "float32")), device=dev)
    out, check = {}, {}
    with torch.no_grad():
        for name, path in spec["files"].items():
            for text, qids in spec["questions"].items():
                cache = serve.open_cache(model, path)
                gen = serve.generate(model, cache, torch.tensor([qids]), max_new_tokens=spec["max_tokens"],
                                     do_sample=False)
                out[f"{name}|{text}"] = gen[0].tolist()
        for rid, c in spec.get("check", {}).items():
            cache = serve.open_cache(model, c["file"])
            new, toks = list(c["new"]), list(c["tokens"])
            seq = torch.tensor([new + toks[:-1]], device=dev)  # forward feeds them all (generate would slice)
            mask = torch.ones(1, cache.prefix_len + seq.shape[1], dtype=torch.long, device=dev)
            logits = model(input_ids=seq, attention_mask=mask, **cache_kwargs(model, cache)).logits
            logits = logits[0, len(new) - 1:].float()  # [n, V]: row i predicts toks[i]
            picked = logits.gather(1, torch.tensor(toks, device=dev)[:, None])[:, 0]
            check[rid] = {"argmax": logits.argmax(-1).tolist(), "margin": (logits.max(-1).values - picked).tolist()}
    json.dump({"hf": out, "check": check}, open(sys.argv[2], "w"))
