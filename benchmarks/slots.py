"""Step time and memory of K LoRA slots on one worker group (runtime/slots.py), packed and time-shared, on the tiny
model.

Builds one LoRA group (lora=r8 by default; the repo's tiny model on 2 CPU gloo workers unless ARGS say otherwise), on
a Ray cluster of its own, and times, after `--warmup` rounds (medians):
  - alone: the group's own train_step, no slots (what one trial a group does); and the possible gain of packing:
    verl's own forward_backward of one batch against 8 batches' rows in micro-batches 8 times larger (what a packed
    step of 8 slots runs through the base model);
  - K = 1, 2, 4, 8, 16 slots (each its own seed, its own batch): a round is one step of every slot, packed (one
    cycle: `SlotGroup.train_steps`) and, paired with it (in alternating order), time-shared (each slot's step in
    turn, swapped in); the ratio packed / time-shared per pair.
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


def possible_gain(workers, pool: list, micro_batch_size: int, args) -> None:
    """verl's forward_backward of one batch against 8 batches' rows with micro-batches 8 times larger (the group's own
    step, each followed by its optimizer step, untimed: the next starts from no gradients)."""
    from verl.utils import tensordict_utils as tu

    one = workers._batch(pool[:8])
    eight = workers._batch([pool[i % len(pool)] for i in range(64)])
    tu.assign_non_tensor(eight, micro_batch_size_per_gpu=8 * micro_batch_size)

    def forward_backward(batch):
        start = time.perf_counter()
        workers.group.forward_backward(batch).get()
        spent = time.perf_counter() - start
        workers.group.optimizer_step(optim_step_params=None)
        return spent

    timings = {"one": [], "eight": []}
    for sample in range(args.warmup + args.rounds):
        for name, batch in [("one", one), ("eight", eight)][:: 1 if sample % 2 else -1]:
            spent = forward_backward(batch)
            if sample >= args.warmup:
                timings[name].append(spent)
    one_s, eight_s = statistics.median(timings["one"]), statistics.median(timings["eight"])
    print(f"verl's forward_backward: 8 rows (micro-batches of {micro_batch_size}) {one_s * 1000:.1f} ms; 64 rows in "
          f"micro-batches of {8 * micro_batch_size} {eight_s * 1000:.1f} ms = {eight_s / one_s:.2f}x for 8x the rows")  # fmt: skip


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
    pool = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples
    examples = pool[: cfg.trainer.batch_size]
    params = plan[0]
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu", lora=cfg.lora)
    try:
        workers.ready()
        alone = timed(lambda: workers.train_step(examples, params), args.rounds, args.warmup)  # before any slot
        print(f"{cfg.lora.rank=} on {cfg.backend.num_workers} CPU workers, batch {len(examples)} rows, "
              f"{sum(len(e.input_ids) for e in examples)} tokens; medians of {args.rounds} rounds after {args.warmup}")  # fmt: skip
        print(f"alone (no slots): step {alone * 1000:.1f} ms")
        possible_gain(workers, pool, cfg.backend.micro_batch_size, args)
        group = SlotGroup(workers, max(counts))
        for k in counts:
            slots = []
            for seed in range(k):
                trial = load([*overrides, f"trainer.seed={seed}"])
                slots.append(group.fill(trial.optimizer, trial.trainer, plan.optimizer_values))
            n = len(examples)
            batches = [[pool[(i * n + j) % len(pool)] for j in range(n)] for i in range(k)]  # each slot its own rows

            def packed_round() -> None:
                group.train_steps([(slot, batch, params) for slot, batch in zip(slots, batches, strict=True)])

            def shared_round() -> None:
                for slot, batch in zip(slots, batches, strict=True):
                    group.train_steps([(slot, batch, params)])  # one slot: its step alone, swapped in

            times: dict[str, list[float]] = {"packed": [], "shared": []}
            for sample in range(args.warmup + args.rounds):
                order = [("packed", packed_round), ("shared", shared_round)][:: 1 if sample % 2 else -1]
                for name, run_round in order:
                    start = time.perf_counter()
                    run_round()
                    if sample >= args.warmup:
                        times[name].append(time.perf_counter() - start)
            ratios = [p / s for p, s in zip(times["packed"], times["shared"], strict=True)]
            packed_s, shared_s = statistics.median(times["packed"]), statistics.median(times["shared"])
            print(f"K={k:>2}: round packed {packed_s * 1000:8.1f} ms ({packed_s / k * 1000:6.1f} a slot), "
                  f"time-shared {shared_s * 1000:8.1f} ms ({shared_s / k * 1000:6.1f} a slot); packed / time-shared, "
                  f"paired: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")  # fmt: skip
            memory = group.memory()
            if k == max(counts):
                per_slot = statistics.median(memory.values())
                print(f"memory per slot on rank 0: {per_slot / 1024:.1f} KiB (adapter shards + optimizer state), "
                      f"{k} slots {sum(memory.values()) / 1024:.1f} KiB")  # fmt: skip
            for slot in slots:
                slot.shutdown()
        print(f"packed steps run (slots in the step: count): {dict(sorted(group.packed.items()))}")
    finally:
        workers.shutdown()
        if ray.is_initialized():
            ray.shutdown()


if __name__ == "__main__":
    main()
