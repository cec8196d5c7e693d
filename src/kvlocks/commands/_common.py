"""Options and output helpers shared by subcommands."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_args(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or local HF directory")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="cpu or cuda")


def load_model(args):
    from kvlocks.models import load

    return load(args.model, dtype=DTYPES[args.dtype], device=args.device)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def bytes_line(stats: dict) -> str:
    """One line: pages, and bytes read per decode step and layer, split into its two parts."""
    if not stats.get("decode_steps"):
        return "no decode steps"
    frac = stats["read_fraction"]
    return (
        f"per decode step and layer: {stats['pages_selected']:.1f} pages, "
        f"{stats['tokens_attended']:.0f} of {stats['context_tokens']:.0f} tokens attended; "
        f"read {human_bytes(stats['bytes_read'])} = selection {human_bytes(stats['selection_bytes'])} "
        f"+ K/V {human_bytes(stats['kv_bytes'])} vs full {human_bytes(stats['full_bytes'])} "
        f"({100 * frac:.1f}%)"
    )
