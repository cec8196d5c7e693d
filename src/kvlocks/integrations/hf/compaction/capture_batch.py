"""Generating reference passes (self-study prompts, questions) run together, as one batch.

Each such pass is a short prompt after the T-token prefix followed by greedy decode steps over
it. Run one after another, three self-study passes of 32 tokens over a 4,096-token prefix of the
bundled model took 12.7 s of a 63 s compaction on two CPU threads: 96 decode steps, each a
full model forward over the whole prefix at batch 1, where the linear layers' weights are read
for one token. As the B rows of one batch (the prefix's K/V repeated B times, each prompt at its
own positions T.., shorter prompts padded at their end and masked out, every row decoding its
own greedy tokens) the same passes take ``generate`` forwards instead of ``B * generate``.

Every pass records the rows it records alone (:class:`~kvlocks.integrations.hf.compaction.recorder.QueryRecorder`
runs them as batch rows with the seeds they have in sequence, padding skipped); the numbers
differ from the sequential run's only by float rounding in batched products.
"""

from __future__ import annotations

import torch

from .passes import QueryPass


def batchable(p: QueryPass) -> bool:
    """Whether a pass can join a batch: one piece continuing the prefix that generates tokens."""
    return p.generate > 0 and not p.segments


def groups(passes: list[QueryPass]) -> list[list[QueryPass]]:
    """Consecutive batchable passes with the same ``generate`` together; every other pass alone."""
    out: list[list[QueryPass]] = []
    for p in passes:
        if out and batchable(p) and batchable(out[-1][0]) and out[-1][0].generate == p.generate:
            out[-1].append(p)
        else:
            out.append([p])
    return out


@torch.inference_mode()
def run_batch(model, cache, batch, group: list[QueryPass]) -> None:
    """Run ``group`` (batchable passes, same ``generate``) as one batch on the prefix in ``cache``.

    ``cache`` is the capture's recording cache holding the T prefix tokens (batch 1); it is left
    as it was. ``batch`` is an empty recording cache of the same kind, filled here; their recorder
    must have been started with :meth:`QueryRecorder.start_passes`.
    """
    from kvlocks.integrations.hf import cache_kwargs

    recorder, num, b = cache.recorder, cache.get_seq_length(), len(group)
    dev = model.device
    for src, dst in zip(cache.layers, batch.layers):  # the prefix repeated per row: [B, Hkv, T, D]
        dst.update(src.keys.expand(b, -1, -1, -1), src.values.expand(b, -1, -1, -1))
    lens = [p.ids.shape[1] for p in group]
    width = max(lens)
    ids = torch.zeros((b, width), dtype=torch.long, device=dev)
    mask = torch.ones((b, num + width), dtype=torch.long, device=dev)
    for i, p in enumerate(group):
        ids[i, :lens[i]] = p.ids[0].to(dev)
        mask[i, num + lens[i]:] = 0  # padding after the shorter prompts: never attended
    pos = num + torch.arange(width, device=dev).expand(b, width)  # [B, W]
    keep = width - min(lens) + 1  # logits of every row's last real token are among the last `keep`
    kw = cache_kwargs(model, batch)
    recorder.valid = lens
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, logits_to_keep=keep, **kw)
    recorder.valid = None
    last = torch.tensor([n - 1 - (width - keep) for n in lens], device=dev)
    logits = out.logits[torch.arange(b, device=dev), last]  # [B, V]
    position = torch.tensor(lens, device=dev)[:, None] + num  # [B, 1]: each row's next position
    for _ in range(group[0].generate):
        nxt = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
        mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)
        out = model(input_ids=nxt, position_ids=position, attention_mask=mask, use_cache=True,
                    logits_to_keep=1, **kw)
        logits = out.logits[:, -1]
        position = position + 1
