"""Cost of one evaluation over the validation set vs one training step over the same tokens.

The default job's tiny model, data and split on 2 Ray CPU workers (micro batch 2), in one process. Each round
times, in a rotating order:
- eval: one evaluation as tinker_exp runs it (`Evaluation.run`: the validation set in training-size batches,
  the last filled up with copies that carry no loss tokens, each through verl's `infer_batch`: eval mode,
  `no_grad`);
- eval (one call): the same sequences through one `infer_batch` call (what the per-batch calls cost);
- train (same tokens): one training step (`TinkerWorkers.train_step`: forward_backward, optimizer_step) on one
  batch of exactly the sequences the evaluation runs, fillers included;
- train (one step): one ordinary training step of the run (trainer.batch_size sequences), for scale.
After the warm-up rounds, prints each one's median and the medians of the per-round ratios.

    .venv/bin/python benchmarks/eval_cost.py [--rounds 15] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (pairs), after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.optim.plan import optimizer_values
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.runtime.worker_output import WorkerOutput
    from tinker_exp.runtime.workers import TinkerWorkers
    from tinker_exp.train.data import batch_for_step, dataset_rows, eval_batches
    from tinker_exp.train.evaluation import Evaluation

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = config.load(compose("config", overrides=["backend=cpu"]))
    trainer = cfg.trainer
    model_path = model_dir(cfg.model)
    train, val = (tokenized.examples for tokenized in load_examples(cfg.data, model_path, *dataset_rows(cfg.data)))
    evaluation = Evaluation(eval_batches(val, trainer.batch_size), 0, 1)
    same_tokens = [example for batch in evaluation.batches for example in batch]

    def tokens(examples: list) -> int:
        return sum(len(example.input_ids) for example in examples)

    with tempfile.TemporaryDirectory() as tmp:
        output = WorkerOutput(Path(tmp) / "workers.log", echo=False)
        values = optimizer_values(cfg.optimizer)
        workers = TinkerWorkers(cfg.backend, cfg.optimizer, trainer, str(model_path), values, "cpu", output)
        workers.ready()
        step = 0

        def run_eval() -> list:
            evaluation.run(workers)
            return same_tokens

        def eval_one_call() -> list:
            workers.evaluate(same_tokens)
            return same_tokens

        def train_same_tokens() -> list:
            workers.train_step(same_tokens, None)
            return same_tokens

        def train_ordinary() -> list:
            nonlocal step
            batch = batch_for_step(train, step, trainer.batch_size, trainer.seed, cfg.data.shuffle)
            workers.train_step(batch, None)
            step += 1
            return batch

        kinds = {
            "eval": run_eval,
            "eval (one call)": eval_one_call,
            "train (same tokens)": train_same_tokens,
            "train (one step)": train_ordinary,
        }
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        sizes: dict[str, list[tuple[int, int]]] = {kind: [] for kind in kinds}
        try:
            for round_ in range(args.warmup + args.rounds):
                order = list(kinds)[round_ % len(kinds) :] + list(kinds)[: round_ % len(kinds)]  # each first in turn
                for kind in order:
                    start = time.perf_counter()
                    examples = kinds[kind]()
                    if round_ >= args.warmup:
                        times[kind].append(time.perf_counter() - start)
                        sizes[kind].append((len(examples), tokens(examples)))
        finally:
            workers.shutdown()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))  # per round: paired

    print(f"{'':22}{'median (ms)':>12}{'min':>9}{'max':>9}{'sequences':>11}{'tokens':>8}{'ms/1k tokens':>14}")
    for kind, values in times.items():
        seqs, toks = (statistics.median(column) for column in zip(*sizes[kind]))
        ms = statistics.median(values) * 1e3
        print(f"{kind:22}{ms:12.1f}{min(values) * 1e3:9.1f}{max(values) * 1e3:9.1f}{seqs:11.0f}{toks:8.0f}{ms / toks * 1e3:14.1f}")
    print("ratios (medians of the per-round ratios):")
    for a, b in (("eval", "train (same tokens)"), ("eval", "train (one step)"), ("eval", "eval (one call)")):
        print(f"  {a} / {b}: {ratio(a, b):.3f}")
    print(
        f"({args.rounds} rounds after {args.warmup} warm-up; validation: {len(val)} sequences, "
        f"{sum(sum(e.loss_mask) for e in val)} loss tokens, in {len(evaluation.batches)} batches of "
        f"{trainer.batch_size} (fillers included); 2 Ray CPU workers, micro batch {cfg.backend.micro_batch_size})"
    )


if __name__ == "__main__":
    main()
