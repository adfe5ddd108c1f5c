"""The model dir and the tokenized examples a run trains on (transformers imports torch: runtime, not pure)."""

from __future__ import annotations

from pathlib import Path

from tinker_exp.config import DataConfig, ModelConfig, resolve_model_path
from tinker_exp.train.data import Row, Tokenized, tokenize


def model_dir(model: ModelConfig) -> Path:
    """model.path (a local dir, or a hub id from the cache, downloaded if need be: before any worker starts), or
    the tiny model built offline (tokenizer trained on the shipped data sets) and cached."""
    if model.path:
        return resolve_model_path(model.path, download=True)
    from tinker_exp.runtime.tiny_model import ensure_tiny_model

    return ensure_tiny_model(vars(model))


def load_examples(data: DataConfig, model_path: Path, train: list[Row], val: list[Row]) -> tuple[Tokenized, Tokenized]:
    """The training and validation rows tokenized with the model's tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenize(train, tokenizer, data, "training"), tokenize(val, tokenizer, data, "validation")
