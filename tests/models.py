"""Models built in the tests, independently of tinker_exp's own builder: a tiny Qwen2 (GQA, ChatML template, no
BOS token, as the real Qwen2 tokenizers) saved as a local dir or into a Hugging Face hub cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import REPO

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    rows = [json.loads(line) for line in (REPO / "tinker_exp/assets/tiny_sft.jsonl").read_text().splitlines() if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([str(v) for row in rows for v in row.values()], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def into_hub_cache(model_dir: Path, cache: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """The layout huggingface_hub keeps (models--org--name/{refs/main, snapshots/REV/}): a hub id found offline."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(model_dir, repo / "snapshots" / revision, dirs_exist_ok=True)
    return repo / "snapshots" / revision
