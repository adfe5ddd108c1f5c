"""The model dir and the tokenized examples a run trains on (transformers imports torch: runtime, not pure)."""

from __future__ import annotations

from pathlib import Path

from tinker_exp.config import DataConfig, ModelConfig, data_path
from tinker_exp.train.data import Example, read_rows, tokenize


def model_dir(model: ModelConfig, data: DataConfig) -> Path:
    """model.path, or the tiny model built offline (tokenizer trained on the data) and cached."""
    if model.path:
        return Path(model.path)
    from tinker_exp.runtime.tiny_model import ensure_tiny_model

    return ensure_tiny_model(vars(model), data_path(data.path))


def load_examples(data: DataConfig, model_path: Path) -> list[Example]:
    from transformers import AutoTokenizer

    rows = read_rows(data_path(data.path), data.prompt_key, data.response_key)
    return tokenize(rows, AutoTokenizer.from_pretrained(model_path), data)
