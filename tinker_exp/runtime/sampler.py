"""The driver's sampler: Hugging Face `generate` from the weights the workers export after every optimizer step.

verl 0.9.1 cannot sample on CPU (its rollouts are vLLM / SGLang / TRT-LLM servers), so the driver holds a copy of
the model, loads the exported tensors into it and samples with temperature, top_k=0, top_p=1 and no other logits
processing: the sampled distribution is softmax(logits / temperature), and its per-token log-probs are what verl's
forward computes for the same tokens (sent as old_log_probs; the difference is the logged mismatch). The served
sampler (runtime/serve_sampler.py) may also limit top_k / top_p and name its own stops; each token's log-prob is
then under the distribution it was drawn from (the kept tokens, renormalised).

Its random state is torch's CPU generator of this process, set before and read after each call, so that a checkpoint
can hold it (`rng_state` / `set_rng_state`) and a resumed run samples what the uninterrupted run sampled.
"""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from tinker_exp.runtime.lora import Adapter

DRIVER_THREADS = 1
"""torch threads in the driver: on a 2-core machine shared with the workers, more made sampling 30x slower."""


@dataclass(frozen=True)
class Sample:
    response_ids: list[int]
    """Up to and with the stop token (when one was sampled)."""
    log_probs: list[float]
    """Each response token's log-prob under the sampling distribution."""
    text: str
    """The response decoded, special tokens left out."""
    stopped: bool = False
    """Whether it ended at a stop (a stop token or string) rather than at the most tokens asked for."""


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """A user turn in the model's chat template, ready for the assistant's answer (plain text without one)."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]


PROCESS_WIDE = threading.RLock()
"""Held while a sampler uses what is one a process: transformers' lazy imports as it loads, torch's global RNG as it
samples (RL trials on slots: several samplers, each in its trial's thread of one process)."""


class HFSampler:
    """A driver-side copy of the model that samples; `load` takes the workers' exported tensors."""

    def __init__(self, model_path: Path, seed: int, reference: bool = False):
        """The model and tokenizer of `model_path` on the driver, sampling from `seed`.

        `reference`: also keep a frozen copy of the initial model (the model dir's weights, the start of every run,
        resumed, branched or pooled alike) for `reference_log_probs` (rl.kl_coef, rl.log_kl_ref)."""
        import copy

        import torch

        with PROCESS_WIDE:  # transformers' lazy imports are not thread-safe: RL trials on slots start theirs at once
            from transformers import AutoModelForCausalLM, AutoTokenizer

            torch.set_num_threads(DRIVER_THREADS)
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            from tinker_exp.runtime import no_progress_bars

            with no_progress_bars():
                self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.reference = copy.deepcopy(self.model) if reference else None
        """The initial model, never loaded into (`load` changes self.model only)."""
        self._rng = torch.Generator().manual_seed(seed).get_state()
        self.stop_ids = sorted({i for i in (self.tokenizer.eos_token_id, self._im_end()) if i is not None})
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.positions = self.model.config.max_position_embeddings
        """The longest sequence the model takes: prompt + max new tokens must fit."""
        self.base: dict[str, Any] | None = None
        """A LoRA run's: the adapted layers' weights as the model dir has them, which each adapter is merged into."""

    def _im_end(self) -> int | None:
        token = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return token if isinstance(token, int) and token != self.tokenizer.unk_token_id else None

    def prompt_ids(self, text: str) -> list[int]:
        return chat_prompt_ids(self.tokenizer, text)

    def load(self, tensors: "dict[str, Any] | Adapter") -> None:
        """Load the workers' exported tensors, or an adapter merged into the base weights, into the driver's model.

        Rotary buffers are not parameters: not sent. An adapter (a LoRA run's export) is merged into the base weights
        the model started with (runtime/lora.py)."""
        from tinker_exp.runtime.lora import Adapter

        start = time.perf_counter()
        if isinstance(tensors, Adapter):
            if self.base is None:  # the first load of a LoRA run: the model still holds the model dir's weights
                state = self.model.state_dict()
                self.base = {name: state[name].detach().clone() for name in tensors.layers}
            self.model.load_state_dict(tensors.merged(self.base), strict=False)
            self.load_time_s = time.perf_counter() - start
            return
        missing, unexpected = self.model.load_state_dict(tensors, strict=False)
        if unexpected or any("rotary" not in name for name in missing):
            raise RuntimeError(f"exported weights do not fit the sampler's model: missing {missing}, unexpected {unexpected}")
        self.load_time_s = time.perf_counter() - start

    def sample(self, prompt_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float, *,
               stop: Sequence[int] | Sequence[str] | None = None, top_k: int = 0, top_p: float = 1.0) -> list[Sample]:
        """`n` responses to one prompt, from this sampler's random state (which it advances).

        `stop`: None, the model's stop tokens; else exactly these token ids, or these strings (a response ends with the
        token that completes one); [] none. `top_k` (0: no limit) and `top_p` (1: no limit) narrow each draw."""
        import torch
        from transformers import GenerationConfig

        strings = [s for s in stop or () if isinstance(s, str)]
        stop_ids = list(self.stop_ids if stop is None else [s for s in stop if not isinstance(s, str)])
        ids = torch.tensor([list(prompt_ids)] * n)
        config = GenerationConfig(
            do_sample=True, temperature=float(temperature), top_k=top_k, top_p=float(top_p), max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids, pad_token_id=self.pad_id, stop_strings=strings or None, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
        with PROCESS_WIDE:  # torch's global RNG holds this sampler's state while it samples
            saved = torch.get_rng_state()
            torch.set_rng_state(self._rng)
            try:
                with torch.no_grad():
                    out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                              tokenizer=self.tokenizer if strings else None)
                self._rng = torch.get_rng_state()
            finally:
                torch.set_rng_state(saved)
        responses = out.sequences[:, ids.shape[1] :]
        # the scores each token was drawn from: logits / temperature, the tokens top_k / top_p drop at -inf
        log_probs = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        samples = []
        for row, row_log_probs in zip(responses.tolist(), log_probs):
            stop_at = next((i + 1 for i, token in enumerate(row) if token in stop_ids), None)
            if strings:  # the first token whose text completes a stop string (before any stop token)
                stop_at = next((i + 1 for i in range(stop_at or len(row))
                                if any(s in self.tokenizer.decode(row[: i + 1]) for s in strings)), stop_at)
            length = stop_at or len(row)
            text = self.tokenizer.decode(row[:length], skip_special_tokens=True)
            samples.append(Sample(row[:length], row_log_probs[:length].tolist(), text, stop_at is not None))
        return samples

    def reference_log_probs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float) -> list[list[float]]:
        """Each response token's log-prob under the initial model, softmax(logits / temperature).

        As the trainer computes the policy's: one forward pass of the prompt's responses, right-padded."""
        import torch

        assert self.reference is not None, "built without a reference (HFSampler(reference=True))"
        longest = max(len(r) for r in responses)
        prompt = list(prompt_ids)
        ids = torch.tensor([prompt + list(r) + [self.pad_id] * (longest - len(r)) for r in responses])
        mask = torch.tensor([[1] * (len(prompt) + len(r)) + [0] * (longest - len(r)) for r in responses])
        with torch.no_grad():
            logits = self.reference(ids, attention_mask=mask).logits.float()
        # the logits at position i score token i + 1: the response's tokens are scored from the prompt's last on
        scores = logits[:, len(prompt) - 1 : len(prompt) - 1 + longest] / temperature
        picked = torch.log_softmax(scores, -1).gather(-1, ids[:, len(prompt) :].unsqueeze(-1)).squeeze(-1)
        return [row[: len(r)] for row, r in zip(picked.tolist(), responses)]

    def prompt_log_probs(self, prompt_ids: Sequence[int]) -> list[float]:
        """Each prompt token's log-prob under the model given the tokens before it; NaN for the first.

        Softmax of the logits, no temperature; the first token has none before it. One forward pass."""
        import torch

        ids = torch.tensor([list(prompt_ids)])
        with torch.no_grad():
            logits = self.model(ids, attention_mask=torch.ones_like(ids)).logits.float()
        scored = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        return [float("nan"), *scored.tolist()]

    def rng_state(self) -> str:
        return base64.b64encode(self._rng.numpy().tobytes()).decode("ascii")

    def state_for(self, seed: int) -> str:
        import torch

        return base64.b64encode(torch.Generator().manual_seed(seed).get_state().numpy().tobytes()).decode("ascii")

    def set_rng_state(self, state: str) -> None:
        import torch

        self._rng = torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8).clone()
