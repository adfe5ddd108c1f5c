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
Each K's tokens a second (packed and time-shared) and MFU on the 4 x N x tokens basis (LoRA: the frozen base has no
weight gradients; N the base's parameters) against the GPU's spec dense bf16 peak (benchmarks/gpu.py's table, or
--peak-tflops) when it is known.

    .venv/bin/python benchmarks/slots.py [--rounds 7] [--warmup 2] [--slots 1,2,4,8,16] [ARGS...]   # ARGS: overrides
    python benchmarks/slots.py --shape 1.5b --device cuda --slots 1,16 --rows 2 --seq 1024 lora.rank=16 lora.alpha=32

`--shape 1.5b`: Qwen2.5-1.5B's shape (benchmarks/gpu.py's random-weight model, bf16, one worker), each slot `--rows`
sequences of `--seq` tokens a step (16 slots x 2 x 1024: the 32,768 tokens of gpu.py's step). `--json PATH` writes
every figure (scripts/gpu_check's stage s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


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


def shape_overrides(args, counts: list[int], tmp: Path) -> tuple[list[str], int | None]:
    """The overrides of `--shape 1.5b` (its model built once and cached, rows for every slot, one worker) and its
    parameter count; none for the tiny model (the config's own)."""
    if args.shape == "tiny":
        return [f"backend.device={args.device}"], None
    from gpu import QWEN25_15B, build_data, build_model

    cache = Path(os.path.expanduser(os.environ.get("TINKER_EXP_CACHE", "~/.cache/tinker_exp")))
    model, n_params = build_model(QWEN25_15B, cache, "bfloat16")
    data = build_data(tmp / "rows.jsonl", args.rows * max(counts), chars=args.seq * 8)
    precision = "bf16" if args.device == "cuda" else "fp32"
    return [f"model.path={model}", f"data.path={data}", f"data.max_length={args.seq}", "data.val_fraction=null",
            f"backend.device={args.device}", f"backend.precision={precision}", "backend.num_workers=1",
            f"trainer.batch_size={args.rows}"], n_params  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--slots", default="1,2,4,8,16")
    parser.add_argument("--shape", choices=("tiny", "1.5b"), default="tiny", help="the repo's tiny model, or Qwen2.5-1.5B's shape")
    parser.add_argument("--device", default="cpu", help="backend.device")
    parser.add_argument("--rows", type=int, default=2, help="--shape 1.5b: sequences a slot's step")
    parser.add_argument("--seq", type=int, default=1024, help="--shape 1.5b: tokens a sequence")
    parser.add_argument("--no-gain", action="store_true", help="skip the possible gain (8 batches' rows at once)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: from its name)")
    parser.add_argument("--json", help="write every figure here")
    args, extra = parser.parse_known_args()
    counts = [int(k) for k in args.slots.split(",")]
    with tempfile.TemporaryDirectory(prefix="tinker_exp-slots-") as tmp:
        shaped, n_params = shape_overrides(args, counts, Path(tmp))
        figures = measure(args, counts, ["lora=r8", "logger=none", "trainer.steps=1000", *shaped, *extra], n_params)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def measure(args, counts: list[int], overrides: list[str], n_params: int | None) -> dict:
    """Every figure printed, and returned for --json."""
    import ray

    from tinker_exp.run import validate
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.runtime.slots import SlotGroup
    from tinker_exp.runtime.workers import TinkerWorkers
    from tinker_exp.train.data import dataset_rows

    from gpu import parameter_count

    cfg = load(overrides)
    plan = validate(cfg)
    model_path = model_dir(cfg.model)
    pool = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples
    examples = pool[: cfg.trainer.batch_size]
    params = plan[0]
    workers = TinkerWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, args.device, lora=cfg.lora)
    n_params = n_params or parameter_count(model_path)
    peak, peak_source = spec_peak_of(args)
    figures: dict = {"args": vars(args), "overrides": overrides, "lora_rank": cfg.lora.rank, "n_params": n_params,
                     "flops_per_token_basis": "4 x N (LoRA: no weight gradients of the frozen base)",
                     "peak_tflops": peak, "peak_source": peak_source, "k": {}}  # fmt: skip
    try:
        workers.ready()
        alone = timed(lambda: workers.train_step(examples, params), args.rounds, args.warmup)  # before any slot
        slot_tokens = sum(len(e.input_ids) for e in examples)
        print(f"{cfg.lora.rank=} on {cfg.backend.num_workers} {args.device} worker(s), {n_params / 1e9:.3f} B parameters, a slot's "
              f"batch {len(examples)} rows, {slot_tokens} tokens; medians of {args.rounds} rounds after {args.warmup}")  # fmt: skip
        print(f"alone (no slots): step {alone * 1000:.1f} ms")
        figures.update(alone_step_s=alone, slot_tokens=slot_tokens, device=workers.choice.describe())
        if not args.no_gain:
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
            tokens = sum(len(e.input_ids) for batch in batches for e in batch)
            rates = {name: tokens / median_s for name, median_s in (("packed", packed_s), ("shared", shared_s))}
            mfu = {name: 4 * n_params * rate / (peak * 1e12) for name, rate in rates.items()} if peak else None
            print(f"      tokens/s packed {rates['packed']:,.0f}, time-shared {rates['shared']:,.0f}"
                  + (f"; MFU (4 x N, {peak_source}) packed {mfu['packed']:.1%}, time-shared {mfu['shared']:.1%}" if mfu else ""))
            figures["k"][k] = {"packed_round_s": packed_s, "shared_round_s": shared_s, "ratio_median": statistics.median(ratios),
                               "tokens": tokens, "tokens_per_s": rates, "mfu": mfu}  # fmt: skip
            memory = group.memory()
            if k == max(counts):
                per_slot = statistics.median(memory.values())
                print(f"memory per slot on rank 0: {per_slot / 1024:.1f} KiB (adapter shards + optimizer state), "
                      f"{k} slots {sum(memory.values()) / 1024:.1f} KiB")  # fmt: skip
                figures["memory_per_slot_bytes"] = per_slot
            for slot in slots:
                slot.shutdown()
        print(f"packed steps run (slots in the step: count): {dict(sorted(group.packed.items()))}")
        figures["peak_memory"] = peak_memory(workers)
    finally:
        workers.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    return figures


def spec_peak_of(args) -> tuple[float | None, str]:
    """The GPU's spec dense bf16 peak (benchmarks/gpu.py's table by the device's name, or --peak-tflops); on CPU none."""
    from gpu import spec_peak

    if args.device != "cuda":
        return (args.peak_tflops, f"--peak-tflops {args.peak_tflops:g}") if args.peak_tflops else (None, "no GPU")
    import torch

    return spec_peak(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, args.peak_tflops)


def peak_memory(workers) -> int | None:
    """torch.cuda.max_memory_allocated on rank 0 (None off a GPU)."""
    if workers.device != "cuda":
        return None
    import ray

    def peak() -> int:
        import torch

        return torch.cuda.max_memory_allocated()

    worker = workers.group.workers[0]
    return ray.get(worker.__ray_call__.remote(lambda self: peak()))


if __name__ == "__main__":
    main()
