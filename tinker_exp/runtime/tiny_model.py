"""Build a tiny causal LM and tokenizer offline (no hub access), cached by their parameters.

The tokenizer is a byte-level BPE trained on the shipped data sets (not the user's data: the default model stays the
same whatever a run trains on), with ChatML turn markers and a ChatML chat template; the model is a randomly
initialised Llama with a fixed seed. Both are saved as an ordinary HF model dir that verl loads like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from tinker_exp.config import DataConfig, data_path
from tinker_exp.train.data import read_rows

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", *CHAT_TOKENS]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (as Qwen's, without a default system turn): a turn is <|im_start|>ROLE\\nCONTENT<|im_end|>\\n."""
CORPUS = ("builtin:tiny_sft.jsonl", "builtin:tiny_chat.jsonl")
"""The tokenizer's training text: the shipped data sets."""


def _corpus_files() -> list[Path]:
    return [data_path(name, "tiny model corpus") for name in CORPUS]


def _cache_key(model_cfg: dict[str, Any]) -> str:
    spec = {k: model_cfg[k] for k in sorted(model_cfg) if k not in ("path", "cache_dir")}
    spec["corpus_sha"] = [hashlib.sha256(path.read_bytes()).hexdigest() for path in _corpus_files()]
    spec["format"] = 2  # 2: trained on both shipped files, ChatML tokens and template
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _corpus_texts() -> list[str]:
    texts = []
    for path in _corpus_files():
        for row in read_rows(path, DataConfig()):
            # a conversation: its roles and contents (the turn markers are special tokens, not learned)
            texts.extend([row.prompt, row.response] if row.messages is None else [t for turn in row.messages for t in turn])
    return texts


def build_tokenizer(vocab_size: int, texts: list[str]) -> Any:
    """The tiny model's tokenizer: byte-level BPE trained on `texts`, with the special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        additional_special_tokens=CHAT_TOKENS,
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build(model_cfg: dict[str, Any], out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(model_cfg["vocab_size"], _corpus_texts())
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=model_cfg["hidden_size"],
        intermediate_size=model_cfg["intermediate_size"],
        num_hidden_layers=model_cfg["num_layers"],
        num_attention_heads=model_cfg["num_heads"],
        num_key_value_heads=model_cfg["num_heads"],
        max_position_embeddings=model_cfg["max_position_embeddings"],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(model_cfg["init_seed"])
    from tinker_exp.runtime import no_progress_bars

    with no_progress_bars():
        LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)


def cache_dir(value: str) -> Path:
    """model.cache_dir as a folder, resolved as Hydra would.

    The default of a ModelConfig made in Python is still the interpolation of TINKER_EXP_CACHE, which unresolved would
    be created literally in the working directory."""
    from omegaconf import OmegaConf

    return Path(os.path.expanduser(OmegaConf.create({"cache_dir": value}).cache_dir))


BUILDING = threading.Lock()
"""Held while this process builds a tiny model: runs on slots are threads of one process, and two of them importing
transformers' lazy modules at once fail (seen: `cannot import name 'LlamaConfig'` in a slot's first run)."""


def ensure_tiny_model(model_cfg: dict[str, Any]) -> Path:
    """Return the cached tiny model's dir, building it first if needed.

    Atomic: concurrent jobs are safe; one build at a time in a process: concurrent threads too."""
    cache = cache_dir(model_cfg["cache_dir"]) / "models"
    target = cache / f"{model_cfg['name']}-{_cache_key(model_cfg)}"
    if (target / "config.json").exists():
        return target
    with BUILDING:
        return target if (target / "config.json").exists() else _build_into(cache, target, model_cfg)


def _build_into(cache: Path, target: Path, model_cfg: dict[str, Any]) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        _build(model_cfg, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; theirs is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
