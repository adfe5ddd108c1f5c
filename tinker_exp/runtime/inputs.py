"""The model dir and the tokenized examples a run trains on (transformers imports torch: runtime, not pure)."""

from __future__ import annotations

from pathlib import Path

from tinker_exp.config import DataConfig, ModelConfig, data_path, model_path
from tinker_exp.train.data import Example, tokenize


def model_dir(model: ModelConfig, data: DataConfig) -> Path:
    """model.path (a local dir, or a hub id from the cache, downloaded if need be: before any worker starts), or
    the tiny model built offline (tokenizer trained on the data) and cached."""
    if model.path:
        return model_path(model.path, download=True)
    from tinker_exp.runtime.tiny_model import ensure_tiny_model

    return ensure_tiny_model(vars(model), data_path(data.path))


def load_examples(data: DataConfig, model_path: Path, *row_sets: list[dict[str, str]]) -> list[list[Example]]:
    """Each set of rows (training, validation) tokenized with the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenize(rows, tokenizer, data) for rows in row_sets]
