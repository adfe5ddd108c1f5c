"""Step time and memory of K LoRA slots on one worker group (runtime/slots.py, time-shared), on the tiny model.

Builds one LoRA group (lora=r8 by default; the repo's tiny model on 2 CPU gloo workers unless ARGS say otherwise), on
a Ray cluster of its own, and times, after `--warmup` rounds:
  - alone: the group's own train_step, no slots (what one trial a group does today);
  - K = 1, 2, 4, 8, 16 slots: a round is one step of every slot's trial in turn (each its own seed, one batch, each
    swapped in); paired with it, one step of slot 0 with nothing to swap: the round over K such steps is what the
    swaps cost (time-sharing's ideal 1.00; a packed step's round would be nearly flat in K on a GPU, not built).
Then the memory each slot holds on rank 0 (its adapter's shards and its optimizer state; the base is shared).

    .venv/bin/python benchmarks/slots.py [--rounds 7] [--warmup 2] [--slots 1,2,4,8,16] [ARGS...]   # ARGS: overrides
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from tinker_exp import config

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return config.load(compose("config", overrides=overrides))


def timed(step, rounds: int, warmup: int) -> float:
    """The median seconds of `step()` over `rounds`, after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--slots", default="1,2,4,8,16")
    args, extra = parser.parse_known_args()
    counts = [int(k) for k in args.slots.split(",")]
    overrides = ["lora=r8", "logger=none", "trainer.steps=1000", *extra]

    import ray

    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.runtime.slots import SlotGroup
    from tinker_exp.runtime.workers import TinkerWorkers
    from tinker_exp.train.data import dataset_rows

    cfg = load(overrides)
    plan = validate(cfg)
    model_path = model_dir(cfg.model)
    examples = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples[: cfg.trainer.batch_size]
    params = plan[0]
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu", lora=cfg.lora)
    try:
        workers.ready()
        alone = timed(lambda: workers.train_step(examples, params), args.rounds, args.warmup)  # before any slot
        print(f"{cfg.lora.rank=} on {cfg.backend.num_workers} CPU workers, batch {len(examples)} rows, "
              f"{sum(len(e.input_ids) for e in examples)} tokens; medians of {args.rounds} rounds after {args.warmup}")  # fmt: skip
        print(f"alone (no slots): step {alone * 1000:.1f} ms")
        group = SlotGroup(workers, max(counts))
        for k in counts:
            slots = []
            for seed in range(k):
                trial = load([*overrides, f"trainer.seed={seed}"])
                slots.append(group.fill(trial.optimizer, trial.trainer, plan.optimizer_values))
            rounds, ratios = [], []
            for sample in range(args.warmup + args.rounds):
                slots[0].train_step(examples, params)  # slot 0 loaded: its next step swaps nothing
                start = time.perf_counter()
                slots[0].train_step(examples, params)
                one = time.perf_counter() - start
                start = time.perf_counter()
                for slot in slots:  # a round: every slot's step, each swapped in (but slot 0's, K = 1)
                    slot.train_step(examples, params)
                round_s = time.perf_counter() - start
                if sample >= args.warmup:
                    rounds.append(round_s)
                    ratios.append(round_s / (k * one))
            round_s = statistics.median(rounds)
            print(f"K={k:>2}: round {round_s * 1000:8.1f} ms, per slot step {round_s / k * 1000:6.1f} ms; "
                  f"round / (K x a slot's step without a swap), paired: median {statistics.median(ratios):.2f} "
                  f"(min {min(ratios):.2f}, max {max(ratios):.2f}; time-sharing's ideal 1.00)")  # fmt: skip
            memory = group.memory()
            if k == max(counts):
                per_slot = statistics.median(memory.values())
                print(f"memory per slot on rank 0: {per_slot / 1024:.1f} KiB (adapter shards + optimizer state), "
                      f"{k} slots {sum(memory.values()) / 1024:.1f} KiB")  # fmt: skip
            for slot in slots:
                slot.shutdown()
    finally:
        workers.shutdown()
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
