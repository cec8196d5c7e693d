"""Options, checks and output helpers shared by subcommands.

Every command checks all its arguments and files (:func:`check_model_args`,
:func:`read_text_file`, :func:`check_output_path`, :func:`read_cache_header`) before
:func:`load_model`, so a mistake is reported in a second, not after the model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MODEL = "smollm2-135m"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after an option's help, except where there is nothing to show
    (a flag, a default of None) or the help already says its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        nothing = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or not action.option_strings or nothing:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose help shows defaults; subcommand parsers inherit it."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def add_model_args(p, *, model_help: str = "") -> None:
    p.add_argument("--model", default=None,
                   help=f"bundled model name or local Hugging Face directory (default: {DEFAULT_MODEL}"
                        f"{model_help})")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model and K/V dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def check_model_args(args) -> None:
    """Model name or directory and device, checked without loading anything."""
    from kvlocks.models import check, check_device

    args.model = args.model or DEFAULT_MODEL
    check_device(args.device, name="--device")
    check(args.model)


def status(message: str, **kw) -> None:
    """A progress or status line for the person at the terminal (stderr; stdout holds results)."""
    print(message, file=sys.stderr, flush=True, **kw)


def load_model(args):
    """Load ``args.model`` with one status line; transformers' own output only with ``-v``."""
    from kvlocks.models import is_converted, load, quiet

    verbose = getattr(args, "verbose", False)
    if not is_converted(args.model) and not Path(args.model).expanduser().is_dir():
        status(f"converting the bundled {args.model} from GGUF once (about a minute; later loads take seconds)")
    status(f"loading {args.model} ({args.dtype}, {args.device}) ...", end="")
    t0 = time.perf_counter()
    with quiet(not verbose):
        model, tok = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    status(f" {time.perf_counter() - t0:.1f} s")
    return model, tok


def read_text_file(flag: str, path: Path) -> str:
    """The text of an input file, or a ``ValueError`` naming the option and what is wrong."""
    if not path.exists():
        raise ValueError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise ValueError(f"{flag} {path}: not a file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot be read as text ({exc})") from None
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty")
    return text


def check_output_path(flag: str, path: Path) -> None:
    """The output file can be written: not a directory, and its nearest existing parent is a
    writable directory (missing parents are created when writing)."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


def read_cache_header(path: Path) -> dict:
    """Format, version, sizes, method and model of a compacted-cache file, from its safetensors
    header only (no tensor is read; :func:`kvlocks.compaction.cachefile.load` checks the rest).

    Returns ``{"T", "t", "method", "model_id", "chat"}`` (``chat``: the prefix is a chat user turn).
    """
    from safetensors import safe_open

    from kvlocks.compaction.cachefile import FORMAT, FORMAT_VERSION
    from kvlocks.compaction.config import METHODS

    if not path.exists():
        raise ValueError(f"--cache {path}: no such file (make one with kvlocks compact --out FILE)")
    if not path.is_file():
        raise ValueError(f"--cache {path}: not a file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise ValueError(f"--cache {path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"--cache {path}: format={meta.get('format')!r}, expected {FORMAT!r} "
                         "(a file written by kvlocks compact)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"--cache {path}: format_version={meta.get('format_version')!r}; this kvlocks "
                         f"reads version {FORMAT_VERSION!r}")
    missing = [k for k in ("T", "t", "method", "model_id") if k not in meta]
    if missing:
        raise ValueError(f"--cache {path}: metadata lacks {missing}")
    try:
        big, small = int(meta["T"]), int(meta["t"])
    except ValueError:
        raise ValueError(f"--cache {path}: metadata T={meta['T']!r}, t={meta['t']!r} must be integers") from None
    if not 1 <= small <= big:
        raise ValueError(f"--cache {path}: need 1 <= t <= T, got T={big}, t={small}")
    if meta["method"] not in METHODS:
        raise ValueError(f"--cache {path}: method={meta['method']!r}; allowed {METHODS}")
    return {"T": big, "t": small, "method": meta["method"], "model_id": meta["model_id"],
            "chat": _made_with_chat(meta.get("reference_config"))}


def _made_with_chat(reference_json) -> bool:
    """Whether the file's prefix is a chat user turn (``kvlocks compact --chat``)."""
    import json

    try:
        ref = json.loads(reference_json) if reference_json else {}
    except ValueError:
        return False  # cachefile.load rejects such a file with its reason
    return isinstance(ref, dict) and ref.get("chat") is True


class Progress:
    """One progress display: a tqdm bar on a terminal, plain lines when stderr is not one
    (logs and CI get no carriage returns): the first and last update, and one at most every
    ``every`` seconds between them."""

    def __init__(self, total: int, desc: str, unit: str, *, disable: bool = False, stream=None,
                 every: float = 5.0):
        self.total, self.desc, self.unit, self.disable, self.every = total, desc, unit, disable, every
        self.stream = stream or sys.stderr
        self.done, self.t0 = 0, time.perf_counter()
        self.printed = None  # time of the last plain line
        self.bar = None
        if not disable and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)

    def update(self, done: int, note: str = "") -> None:
        """Set the count of finished items to ``done``; ``note`` names the current one."""
        self.done = done
        if self.disable:
            return
        if self.bar is not None:
            self.bar.n = done
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.refresh()
            return
        now = time.perf_counter()
        if self.printed is not None and done < self.total and now - self.printed < self.every:
            return
        self.printed = now
        extra = f": {note}" if note else ""
        print(f"{self.desc} {done}/{self.total}{extra} ({time.perf_counter() - self.t0:.0f} s)",
              file=self.stream, flush=True)

    def step(self, note: str = "") -> None:
        self.update(self.done + 1, note)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def bytes_line(stats: dict, *, original: dict | None = None) -> str:
    """One line: pages, and bytes read per decode step and layer, split into its two parts.

    ``original``: with a compacted prefix, ``{"T": ..., "t": ...}``; the line then compares the
    read with full attention over the compacted cache *and* over the original T-token prefix.
    """
    if not stats.get("decode_steps"):
        return "no decode steps"
    read = (
        f"per decode step and layer: {stats['pages_selected']:.1f} pages, "
        f"{stats['tokens_attended']:.0f} of {stats['context_tokens']:.0f} tokens attended; "
        f"read {human_bytes(stats['bytes_read'])} = selection {human_bytes(stats['selection_bytes'])} "
        f"+ K/V {human_bytes(stats['kv_bytes'])}"
    )
    full = f"full {human_bytes(stats['full_bytes'])} ({100 * stats['read_fraction']:.1f}%)"
    from kvlocks.integrations.hf.stats import layers_line

    kinds = layers_line(stats) if "window" in stats.get("layers", {}) else ""  # a hybrid model's layer kinds
    if original is not None:
        full = (f"{full} over the compacted cache and {human_bytes(stats['original_full_bytes'])} "
                f"({100 * stats['original_read_fraction']:.1f}%) over the original {original['T']}-token prefix")
    return f"{read} vs {full}" + (f"; {kinds}" if kinds else "")


def add_original_fractions(stats: dict, big: int, small: int) -> dict:
    """Add ``original_full_bytes`` and ``original_read_fraction``: dense attention's K/V read if
    the prefix had not been compacted (T instead of t entries; full bytes grow linearly with the
    context, so the averages scale exactly). A hybrid model's window layers read their window
    either way: only its global layers' bytes grow."""
    if not stats.get("decode_steps") or not stats.get("context_tokens"):
        return stats
    kinds, layers = stats.get("by_kind") or {}, stats.get("layers") or {}
    if "window" in kinds:
        grown = sum(layers[k] * s["full_bytes"] * (1 + (big - small) / s["context_tokens"])
                    if k != "window" else layers[k] * s["full_bytes"] for k, s in kinds.items())
        orig = grown / sum(layers.values())
    else:
        ctx = stats["context_tokens"]  # mean entries per step: t + tokens appended
        orig = stats["full_bytes"] * (ctx + big - small) / ctx
    return {**stats, "original_full_bytes": orig, "original_read_fraction": stats["bytes_read"] / orig}
