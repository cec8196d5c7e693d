"""How many radix passes the selection runs, with and without rebased keys (CPU, plain PyTorch).

The selection kernels (:mod:`kvlocks.selection.triton`) find each chunk's top-m pages by an
early-stopping radix select over order-preserving uint32 keys of the ranking: 5-bit digits from
the top, one histogram pass each, stopping once every key left in the threshold digit is chosen.
Each pass is a chain of block-wide reductions, so the number of passes sets the selection's
latency. Rankings are GQA mean shares, positive floats of similar magnitude: their keys share the
sign bit and the exponent's top bits, so the first digit says little. The kernels rebase each
program's keys to ``(key - min) << shift`` (the highest differing bit at bit 31; same order).

This emulates the passes (the same digit rule and early stop as the kernel) on synthetic rankings:
per-head logits ~ N(0, sigma^2) over P pages, softmax per head, mean over G heads; chunks of CH
pages choose k, then the merge chooses k of the chunks' winners. It also checks that both key maps
select the same pages. JSON to ``--out``.

    python scripts/analysis/radix_passes.py --out DIR/radix_passes.json
"""

from __future__ import annotations

import argparse
import json

import torch


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint32 keys (in int64) with the same order, as the kernel's ``_orderkey``."""
    u = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where((u >> 31) != 0, (~u) & 0xFFFFFFFF, u | 0x80000000)


def rebased(keys: torch.Tensor) -> torch.Tensor:
    """``(key - min) << shift`` with the shift from the float32 exponent of max - min (the kernel's rule)."""
    lo = int(keys.min())
    diff = int(keys.max()) - lo
    if diff == 0:
        return keys - lo
    e = ((int(torch.tensor(float(diff), dtype=torch.float32).view(torch.int32)) >> 23) & 0xFF) - 127
    return ((keys - lo) << max(31 - e, 0)) & 0xFFFFFFFF


def radix_select(keys: torch.Tensor, need: int, bits: int = 5) -> tuple[int, torch.Tensor]:
    """(passes, selected mask): the ``need`` largest keys, ties to the lower index, by early-stopping
    radix passes of ``bits``-bit digits from the top."""
    digits = (32 + bits - 1) // bits
    remaining, prefix, kmask, n_in, i = max(need, 1), 0, 0, keys.numel(), 0
    while i < digits and n_in > remaining:
        shift, width = max(32 - bits * (i + 1), 0), min(32 - bits * i, bits)
        dmask = (1 << width) - 1
        d = (keys[(keys & kmask) == prefix] >> shift) & dmask
        hist = torch.bincount(d, minlength=1 << bits)
        ge = hist.flip(0).cumsum(0).flip(0)
        dstar = int((ge >= remaining).nonzero().max())
        remaining -= int(hist[dstar + 1:].sum())
        n_in = int(hist[dstar])
        prefix |= dstar << shift
        kmask |= dmask << shift
        i += 1
    km = keys & kmask
    ties = km == prefix
    sel = (km > prefix) | (ties & (torch.cumsum(ties.long(), 0) - 1 < remaining))
    return i, sel


def study(sigma: float, g: int, pages: int, chunk: int, k: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    share = torch.softmax(torch.randn(g, pages, generator=gen) * sigma, dim=-1).mean(0)
    keys = order_keys(share)
    out = {"sigma": sigma, "heads": g, "pages": pages, "chunk": chunk, "k": k}
    for name, fn in (("plain", lambda x: x), ("rebased", rebased)):
        passes, winners = [], []
        for c in range(0, pages, chunk):
            n, sel = radix_select(fn(keys[c:c + chunk]), k)
            passes.append(n)
            winners.append(c + sel.nonzero()[:, 0])
        idx = torch.cat(winners)
        n_merge, sel = radix_select(fn(keys[idx]), k)
        out[f"{name}_chunk_passes"] = sum(passes) / len(passes)
        out[f"{name}_merge_passes"] = n_merge
        out[f"{name}_pages"] = sorted(idx[sel].tolist())
    assert out["plain_pages"] == out["rebased_pages"] == sorted(share.topk(k).indices.tolist())
    del out["plain_pages"], out["rebased_pages"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pages", type=int, default=65536, help="pages per row (1M tokens)")
    ap.add_argument("--chunk", type=int, default=4096, help="pages per chunk program (the fused default at 1M)")
    ap.add_argument("--k", type=int, default=126, help="pages chosen by ranking (budget 2048: 128 - sink - recent)")
    args = ap.parse_args()
    rows = []
    for sigma in (0.5, 1.0, 3.0):
        for g in (4, 8):
            rows.append(study(sigma, g, args.pages, args.chunk, args.k, seed=len(rows)))
            print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": f"scripts/analysis/radix_passes.py --pages {args.pages} --chunk {args.chunk} "
                              f"--k {args.k}", "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
