"""kvlocks' own decode engine on the bundled model (CUDA, Triton kernels, no CUDA graph), recording
the pages LOCKS selects per (layer, seq_len), for comparison with the vLLM backend's trace.

Usage: python engine_ref.py SPEC.json OUT.json. SPEC: {"prompt_ids": [...], "locks": LocksConfig
JSON, "max_tokens": int, "dtype": "bfloat16"}. OUT: {"tokens", "records": [{"layer", "seq_len",
"pages": [[...] per KV head], "ranking": [[score per full page] per KV head]}]}. ``seq_len`` counts the step's own token, as in the vLLM trace.
"""

import json
import sys

if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    import torch

    from kvlocks.config import LocksConfig
    from kvlocks.engine import DecodeEngine, EngineConfig
    from kvlocks.engine.attention import LocksAttention
    from kvlocks.models import load
    from kvlocks.plan import paged_score

    model, _ = load("smollm2-135m", dtype=getattr(torch, spec.get("dtype", "bfloat16")), device="cuda")
    ids = spec["prompt_ids"]
    records = []
    real = LocksAttention.run

    def spy(self, layer, q, seq_lens, *, build=True):
        out = real(self, layer, q, seq_lens, build=build)
        c, n = self.cache, int(seq_lens[0])
        # the PyTorch reference's combined ranking from this engine's own summaries (float32)
        _, _, ranking = paged_score(q, c.summaries[layer], c.block_table, seq_lens, scale=self.scale,
                                    combine=c.config.combine, backend="torch")
        records.append({"layer": layer, "seq_len": n, "pages": self.plan.pages[0].tolist(),
                        "ranking": [[round(x, 5) for x in h] for h in ranking[0, :, : n // c.config.page_size].tolist()]})
        return out

    LocksAttention.run = spy
    cfg = EngineConfig(method="locks", locks=LocksConfig.from_json(spec["locks"]), batch=1,
                       max_context=len(ids) + spec["max_tokens"] + 16, cuda_graph=False, tune_attention=False)
    eng = DecodeEngine(model, cfg)
    tokens = eng.generate(torch.tensor([ids], device="cuda"), max_new_tokens=spec["max_tokens"])
    json.dump({"tokens": tokens[0].tolist(), "records": records}, open(sys.argv[2], "w"))
