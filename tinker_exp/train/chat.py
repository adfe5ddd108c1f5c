"""Conversations -> token ids and loss mask through the tokenizer's own chat template.

Pure Python: the tokenizer is passed in (any HF fast tokenizer).

The ids are the template's rendering of the whole conversation, tokenized: what ``apply_chat_template(messages)``
gives. The mask is 1 on every assistant turn, from its content to its end-of-turn token included (the first
special token after the content: ``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...), as multi-turn SFT in TRL and verl.
Where a turn starts and ends is found by rendering prefixes of the conversation (up to the turn, with the
generation prompt; through the turn) and finding them at the start of the whole rendering. That holds for any
template whose prefixes render as prefixes; a template that renders a turn differently once more turns follow
(one that drops earlier reasoning, say) is refused, naming the row.
"""

from __future__ import annotations

from typing import Any

from tinker_exp.errors import ConfigError


def check_chat_tokenizer(tokenizer: Any, where: str) -> None:
    """messages rows need a chat template, and a fast tokenizer (character offsets place the turns)."""
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: messages rows need a chat template, and the tokenizer of {name} has none")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"{where}: messages rows need a fast tokenizer (character offsets), and {name}'s is not")


def special_ids(tokenizer: Any) -> set[int]:
    """Every special token: the named ones and added tokens marked special (Llama 3's <|eot_id|> is only the latter)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}


def _render(tokenizer: Any, messages: list[dict[str, str]], where: str, generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError  # what a template raises on a conversation it refuses (raise_exception)

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as e:
        raise ConfigError(f"{where}: the chat template refuses this conversation ({e})") from None


def chat_tokens(
    messages: list[dict[str, str]], tokenizer: Any, where: str, specials: set[int]
) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation; `where` (config key, file, row) names it in errors."""
    full = _render(tokenizer, messages, where)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], where, generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], where)
        if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
            raise ConfigError(
                f"{where}: the chat template does not render messages[{i}] (assistant) the same with and without "
                f"the turns after it, so its tokens cannot be located (prefixes must render as prefixes)"
            )
        start, end = len(before), len(through)
        # Look for the end of turn after the content where the template copies it verbatim: a special token's text
        # inside the content would otherwise end the turn early. (A template may trim it: then from the turn start.)
        content = message["content"]
        after = start + len(content) if full.startswith(content, start) else start
        eot = next((t for t, (s, e) in enumerate(offsets) if s >= after and e <= end and ids[t] in specials), None)
        if eot is None:
            raise ConfigError(
                f"{where}: the chat template puts no special token (end of turn) after messages[{i}] (assistant)"
            )
        first = next(t for t, (_, e) in enumerate(offsets) if e > start)  # a token across the turn's start counts
        mask[first : eot + 1] = [1] * (eot + 1 - first)
    return ids, mask
