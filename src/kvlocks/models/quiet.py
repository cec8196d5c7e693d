"""Silence the libraries' own output while a model loads (the CLI prints one line instead)."""

from __future__ import annotations

import contextlib
import io
import sys
import warnings


@contextlib.contextmanager
def quiet(enabled: bool = True):
    """While active: transformers logs errors only, its progress bars are off, Python warnings
    are ignored and anything else written to stderr (the gguf reader's own tqdm bar) is held
    back; it is written out only if the block raises. Everything is restored on exit.

    ``enabled=False`` changes nothing (``kvlocks -v``).
    """
    if not enabled:
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    held = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(held):
            warnings.simplefilter("ignore")
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
