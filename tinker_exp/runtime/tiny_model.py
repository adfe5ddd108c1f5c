"""Build a tiny causal LM and tokenizer offline (no hub access), cached by their parameters.

The tokenizer is a byte-level BPE trained on the shipped SFT data; the model is a randomly initialised
Llama with a fixed seed. Both are saved as an ordinary HF model dir that verl loads like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]


def _cache_key(model_cfg: dict[str, Any], corpus: Path) -> str:
    spec = {k: model_cfg[k] for k in sorted(model_cfg) if k not in ("path", "cache_dir")}
    spec["corpus_sha"] = hashlib.sha256(corpus.read_bytes()).hexdigest()
    spec["format"] = 1
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _corpus_texts(corpus: Path) -> list[str]:
    texts = []
    for line in corpus.read_text().splitlines():
        if line.strip():
            texts.extend(str(v) for v in json.loads(line).values())
    return texts


def _build(model_cfg: dict[str, Any], corpus: Path, out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=model_cfg["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(corpus), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
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
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out)


def ensure_tiny_model(model_cfg: dict[str, Any], corpus: Path) -> Path:
    """Return the cached model dir, building it first if needed (atomic: concurrent jobs are safe)."""
    cache = Path(os.path.expanduser(model_cfg["cache_dir"])) / "models"
    target = cache / f"{model_cfg['name']}-{_cache_key(model_cfg, corpus)}"
    if (target / "config.json").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        _build(model_cfg, corpus, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first; theirs is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
