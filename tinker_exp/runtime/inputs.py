"""The model dir and the tokenized examples a run trains on (transformers imports torch: runtime, not pure)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tinker_exp.config import Config, DataConfig, ModelConfig, resolve_model_path
from tinker_exp.train.data import Row, Tokenized, tokenize

if TYPE_CHECKING:
    from tinker_exp.rl.env import Env


def model_dir(model: ModelConfig) -> Path:
    """The model's dir: model.path (a local dir, or a hub id from the cache), or the tiny model built offline.

    A hub id not cached is downloaded if need be, before any worker starts; the tiny model (tokenizer trained on the
    shipped data sets) is built offline and cached."""
    if model.path:
        return resolve_model_path(model.path, download=True)
    from tinker_exp.runtime.tiny_model import ensure_tiny_model

    return ensure_tiny_model(vars(model))


def load_examples(data: DataConfig, model_path: Path, train: list[Row], val: list[Row]) -> tuple[Tokenized, Tokenized]:
    """The training and validation rows tokenized with the model's tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenize(train, tokenizer, data, "training"), tokenize(val, tokenizer, data, "validation")


def check_env_fits_model(cfg: Config, env: Env) -> None:
    """Check, in a dry run, that each prompt plus env.max_new_tokens fits the model's positions.

    What an RL run checks once it has its sampler (assemble.rl_inputs), without the model's weights or any worker: each
    prompt, rendered with the model's tokenizer and chat template as the sampler renders it, plus env.max_new_tokens
    fits the model's positions (max_position_embeddings, what the sampler reads)."""
    from transformers import AutoConfig, AutoTokenizer

    from tinker_exp.rl.prompts import check_prompt_lengths
    from tinker_exp.runtime.sampler import chat_prompt_ids

    model_path = model_dir(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    positions = AutoConfig.from_pretrained(model_path).max_position_embeddings
    for rows in (env.train, env.eval):
        check_prompt_lengths(rows, [len(chat_prompt_ids(tokenizer, row.prompt)) for row in rows], cfg.env.max_new_tokens, positions)
