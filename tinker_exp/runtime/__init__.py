"""The runtime: verl and Ray wiring (worker group, CPU platform plugin), the model and tokenizer.

The only package that imports torch, verl, ray or transformers; everything above it stays importable without them.
"""

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while a small model is saved or loaded.

    "Writing model shards", "Loading weights": a bar for one file, on a run's terminal."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
