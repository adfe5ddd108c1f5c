"""Validation between optimizer steps: the loss on held-out rows, token-weighted over the whole set."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tinker_exp.train.data import Example
from tinker_exp.train.protocols import Workers


def missing_evaluation_data(config: Any) -> str | None:
    """What a run of `config` lacks to be evaluated, or None.

    `config`: typed or a DictConfig (trainer, data, env). An RL run (an env with prompts) is evaluated on its held-out
    prompts, any other run on validation data. One rule for every search method that judges runs at evaluations (a
    study's pruner, a population's boundaries)."""
    env = getattr(config, "env", None)
    if getattr(env, "prompts", None) is not None:
        return None if env.eval_prompts is not None else "the env has no held-out prompts (env.eval_prompts)"
    if config.data.val_path is None and config.data.val_fraction is None:
        return "there is no validation data (data.val_path or data.val_fraction)"
    return None


@dataclass
class Evaluation:
    batches: list[list[Example]]
    """The validation set in batches the workers can split (see data.eval_batches)."""
    every: int
    """After every N steps (0: only after the last)."""
    total_steps: int

    def due(self, steps_done: int) -> bool:
        return bool(self.every and steps_done % self.every == 0) or steps_done == self.total_steps

    def run(self, workers: Workers, steps_done: int | None = None) -> dict[str, Any]:
        """val/loss over every validation token, with the evaluation's token count and time.

        verl's loss of a batch is its token-weighted mean NLL (sft_loss divides by the batch's loss tokens), so
        weighting each batch by its loss tokens gives the mean over every validation token, not a mean of means."""
        start = time.perf_counter()
        nll, tokens = 0.0, 0
        for batch, loss in zip(self.batches, workers.evaluate_batches(self.batches), strict=True):
            batch_tokens = sum(sum(example.loss_mask) for example in batch)
            nll += loss * batch_tokens
            tokens += batch_tokens
        return {"val/loss": nll / tokens, "val/tokens": tokens, "perf/eval_time_s": time.perf_counter() - start}
