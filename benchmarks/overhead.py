"""tinker_exp's loop against the true bare verl loop: paired runs, medians, spreads and ratios.

- bare: verl's own TinkerTrainingWorker on a Ray worker group, with nothing added but the gloo start-up verl lacks on
  CPU (and the CPU platform plugin); its driver calls forward_backward and optimizer_step (the same override as
  tinker_exp's run, every step) and writes a line per step. No Hydra, no read-back, no checks, no sinks. Its
  batches are tokenised ahead by this script (the same batches tinker_exp trains on), so its start-up does less.
- tinker_exp: `python -m tinker_exp` as a user runs it (W&B offline, metrics.jsonl, checkpoints, evaluation).

Both train the same model, data, device, precision and attention (resolved once, here, as tinker_exp resolves
them), each in its own process with its own Ray (or the cluster in RAY_ADDRESS). Each pair runs both, the first
alternating. Per run: the median step time (wall time between consecutive finished steps, logging included) and
the time from process start to the end of the first step. Printed: every pair, the medians, their spread
(min..max), and the per-pair ratios' median and spread.

Then the step time without the drift between runs on a shared machine: one process, one Ray,
both worker groups, the two loops' step k back to back (the bare loop's, then tinker_exp's through its real
`run()`, logging included); printed: both medians, the per-step ratio's median and quartiles.

    .venv/bin/python benchmarks/overhead.py [--pairs 5] [--steps 40] [--set KEY=VALUE ...] [--no-interleaved]

The GPU machine's benchmark is benchmarks/gpu.py (docs/devices.md); this script's earlier `--gpu` variant is retired.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TINY_QWEN2 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256)  # fmt: skip
"""benchmarks/gpu.py's tiny shapes (CI, on CPU)."""


# --- the bare loop ----------------------------------------------------------------------------------------------
class BareGroup:
    """verl's TinkerTrainingWorker on a Ray worker group (Ray connected), driven directly."""

    def __init__(self, spec: dict):
        from functools import partial

        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.engine_workers_tinker import TinkerTrainingWorker
        from verl.workers.utils.losses import sft_loss

        device = spec["device"]
        worker_cls = gloo_worker_class() if device == "cpu" else TinkerTrainingWorker
        pool = RayResourcePool(process_on_nodes=[spec["num_workers"]], use_gpu=device == "cuda", max_colocate_count=1)
        init = RayClassWithInitArgs(cls=ray.remote(worker_cls), config=bare_worker_config(spec))
        self.group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=init, device_name=device, worker_env=spec["env"])
        self.group.reset()
        self.group.set_loss_fn(partial(sft_loss, config=None))
        self.params = {**spec["step_params"], "betas": tuple(spec["step_params"]["betas"])}

    def step(self, ids: list[list[int]], masks: list[list[int]]) -> float:
        """One step (the batch built as tinker_exp builds it); returns verl's loss."""
        import torch
        from verl.utils import tensordict_utils as tu

        def nested(rows):
            return torch.nested.as_nested_tensor([torch.tensor(r, dtype=torch.long) for r in rows], layout=torch.jagged)

        batch = tu.get_tensordict(
            tensor_dict={"input_ids": nested(ids), "position_ids": nested([list(range(len(r))) for r in ids]),
                         "loss_mask": nested(masks)},
            non_tensor_dict={"temperature": 1.0, "global_token_num": [len(r) for r in ids]},
        )  # fmt: skip
        output = self.group.forward_backward(batch).get()
        self.group.optimizer_step(optim_step_params=self.params)
        loss = output.get_non_tensor("metrics")["loss"]
        return float(sum(loss) / len(loss) if isinstance(loss, list) else loss)

    def placement(self) -> list[dict]:
        """Where each worker's model is (asked of the actors themselves: verl's worker has no method for it)."""
        import ray

        def where(worker) -> dict:
            import torch

            parameter = next(worker.engine.module.parameters())
            info = {"parameters": str(parameter.device),
                    "attention": getattr(worker.engine.module.config, "_attn_implementation", None)}  # fmt: skip
            if torch.cuda.is_available():
                info["cuda_device"] = torch.cuda.current_device()
            return info

        return ray.get([w.__ray_call__.remote(where) for w in self.group.workers])


def gloo_worker_class():
    import torch
    import torch.distributed as dist
    from verl.workers.engine_workers_tinker import TinkerTrainingWorker

    class GlooTinkerTrainingWorker(TinkerTrainingWorker):
        """The one thing verl lacks on CPU: a gloo process group made before its own init (which asks for
        "cpu:gloo,cpu:gloo"), one thread per worker."""

        def __init__(self, config):
            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
                torch.set_num_threads(1)
            super().__init__(config)

    return GlooTinkerTrainingWorker


def bare_loop(spec_path: Path, out: Path) -> None:
    """The bare loop's process: start Ray and the group, then a line per step; `spec`: what to build, the batches."""
    spec = json.loads(spec_path.read_text())
    os.environ.update(spec["env"])  # before verl is imported: its platform (on CPU, the plugin) is chosen at import
    import ray
    import verl.workers.engine_workers_tinker  # noqa: F401  (the imports a bare script starts with)

    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", runtime_env={"env_vars": spec["env"]},
             include_dashboard=False, configure_logging=False)  # fmt: skip
    group = BareGroup(spec)
    with open(out, "w") as f:
        for step, (ids, masks) in enumerate(spec["batches"]):
            loss = group.step(ids, masks)
            f.write(json.dumps({"step": step, "time": time.time(), "loss": loss}) + "\n")
            f.flush()
        f.write(json.dumps({"workers": group.placement()}) + "\n")  # after the loop, untimed: where the ranks ran (the last line)
    ray.shutdown()


def interleaved(overrides: list[str], spec: dict, tmp: Path) -> tuple[list[float], list[float]]:
    """Step time without the drift of a shared machine: one process, one Ray, both worker groups; each step k is
    the bare loop's step k, then tinker_exp's step k through its real loop (`run()`: checks, sinks, evaluation,
    checkpoints), from the end of the bare step to the start of the next (so its logging is in). Returns the
    per-step times (bare, tinker_exp); the last step has no next start and is left out."""
    os.environ.update(spec["env"])
    import ray
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.assemble import verl_workers
    from tinker_exp.place import GivenWorkers
    from tinker_exp.run import run

    ray.init(address="local", num_cpus=2 * spec["num_workers"], runtime_env={"env_vars": spec["env"]},
             include_dashboard=False, configure_logging=False)  # fmt: skip
    bare = BareGroup(spec)
    starts: list[float] = []
    ends: list[float] = []

    class Alternating:
        """tinker_exp's workers, each of whose steps comes right after the bare loop's same step."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def train_step(self, examples, optim_step_params):
            starts.append(time.time())
            bare.step(*spec["batches"][len(ends)])
            ends.append(time.time())
            return self.inner.train_step(examples, optim_step_params)

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        dcfg = compose("config", overrides=overrides)
    run(dcfg, tmp / "interleaved", place=GivenWorkers(lambda *args: Alternating(verl_workers(*args))))
    ray.shutdown()
    return [e - s for s, e in zip(starts, ends)][:-1], [s - e for e, s in zip(ends, starts[1:])]


def bare_worker_config(spec: dict):
    """The verl worker config, written out with verl's own classes: the same values TinkerWorkers sends
    (tests/test_benchmarks.py holds them equal)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, TrainingWorkerConfig

    values, knobs = spec["optimizer_values"], spec["throughput"]
    tokens = knobs["micro_batch_tokens"] or None
    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(path=spec["model_path"], override_config={"attn_implementation": spec["attention"]},
                                   enable_gradient_checkpointing=knobs["gradient_checkpointing"],
                                   use_remove_padding=knobs["padding_free"], use_fused_kernels=knobs["fused_lm_head"],
                                   use_liger=spec["liger"],
                                   fused_kernel_options={"impl_backend": "torch"} if knobs["fused_lm_head"] else {}),  # fmt: skip
        engine_config=FSDPEngineConfig(
            strategy=spec["strategy"], use_dynamic_bsz=tokens is not None, max_token_len_per_gpu=tokens,
            infer_max_token_len_per_gpu=tokens, micro_batch_size_per_gpu=spec["micro_batch_size"],
            infer_micro_batch_size_per_gpu=spec["micro_batch_size"],
            mixed_precision={"param_dtype": spec["precision"], "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
            use_torch_compile=knobs["torch_compile"], reshard_after_forward=knobs["reshard_after_forward"], seed=spec["seed"],
        ),  # fmt: skip
        optimizer_config=FSDPOptimizerConfig(
            optimizer=spec["optimizer"], lr=values["lr"], betas=tuple(values["betas"]), weight_decay=values["weight_decay"],
            override_optimizer_config={"eps": values["eps"], **knobs["optimizer_kernel"]}, clip_grad=spec["clip_grad"],
            lr_scheduler_type="constant", total_training_steps=spec["steps"],
        ),  # fmt: skip
        checkpoint_config=CheckpointConfig(save_lora_only=False),
    )


# --- benchmarks/gpu.py's model and data, built offline --------------------------------------------------------------
def bench_model(shape: dict, cache: Path, dtype: str, device: str = "cpu") -> Path:
    """A Qwen2 of `shape`, random weights (seed 0), with tinker_exp's tiny byte-level tokenizer; cached. Built on
    `device` (cuda: seconds for 1.5B parameters, but this process then holds a CUDA context)."""
    import hashlib

    key = hashlib.sha256(json.dumps({**shape, "dtype": dtype}, sort_keys=True).encode()).hexdigest()[:10]
    target = cache / "models" / f"bench-qwen2-{key}"
    if (target / "config.json").exists():
        return target
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tinker_exp.runtime.tiny_model import _corpus_texts, build_tokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        tokenizer = build_tokenizer(384, _corpus_texts())
        tokenizer.save_pretrained(staging)
        config = Qwen2Config(**shape, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        torch.manual_seed(0)
        # on CPU by default: a CUDA context in this process would hold GPU memory through every run it times
        with torch.device(device):
            Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(staging)
        if device == "cuda":
            torch.cuda.empty_cache()
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def bench_data(cache: Path) -> Path:
    """Prompt/response rows longer than any max_length used here: the shipped rows strung together."""
    rows = [json.loads(line) for line in (REPO / "tinker_exp/assets/tiny_sft.jsonl").read_text().splitlines() if line.strip()]
    path = cache / "bench_long_rows.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(64):
            part = [rows[(i * 24 + j) % len(rows)] for j in range(24)]
            f.write(json.dumps({"prompt": " ".join(r["prompt"] for r in part[:4]),
                                "response": "\n".join(f"{r['prompt']} {r['response']}" for r in part[4:])}) + "\n")  # fmt: skip
    return path


# --- one pair, the parent -------------------------------------------------------------------------------------------
def prepare(overrides: list[str], tmp: Path) -> tuple[dict, dict]:
    """Compose tinker_exp's config as its CLI would, resolve the device, tokenise its batches: the bare loop's spec."""
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.run import validate
    from dataclasses import asdict

    from tinker_exp.runtime.device import resolve, throughput
    from tinker_exp.runtime.inputs import load_examples, model_dir
    from tinker_exp.runtime.workers import platform_env
    from tinker_exp.train.data import batch_for_step, dataset_rows

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = config.load(compose("config", overrides=overrides))
    plan = validate(cfg)
    choice = resolve(cfg.backend)
    model_path = model_dir(cfg.model)
    examples = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples
    t = cfg.trainer
    batches = [batch_for_step(examples, step, t.batch_size, t.seed, cfg.data.shuffle) for step in range(t.steps)]
    spec = {
        "env": {k: v for k, v in platform_env(choice.device).items() if k not in ("TMPDIR",)},
        "device": choice.device, "precision": choice.precision, "attention": choice.attention, "liger": choice.liger,
        "model_path": str(model_path), "num_workers": cfg.backend.num_workers, "strategy": cfg.backend.strategy,
        "micro_batch_size": cfg.backend.micro_batch_size, "seed": t.seed, "steps": t.steps,
        "optimizer": cfg.optimizer.name.value, "clip_grad": cfg.optimizer.max_grad_norm,
        "throughput": asdict(throughput(cfg.backend, choice.device, cfg.optimizer.name.value, choice.attention)),
        "optimizer_values": plan.optimizer_values, "step_params": plan[0],
        "batches": [[[e.input_ids for e in batch], [e.loss_mask for e in batch]] for batch in batches],
    }  # fmt: skip
    return spec, {"tokens": [sum(len(e.input_ids) for e in batch) for batch in batches], "choice": choice}


def timed(command: list[str], rows_of) -> tuple[float, list[dict]]:
    """Run `command` (stdout and stderr kept in case it fails); its process start and its rows."""
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    start = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return start, rows_of()


def figures(start: float, times: list[float]) -> tuple[float, float]:
    """(median step time, process start to the end of the first step)."""
    return statistics.median(b - a for a, b in zip(times, times[1:])), times[0] - start


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


def quartiles(values: list[float], fmt: str) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"{format(q2, fmt)} ({format(q1, fmt)}..{format(q3, fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="paired runs")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, both loops")
    parser.add_argument("--no-interleaved", action="store_true", help="skip the one-process step measurement")
    parser.add_argument("--bare", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-run", nargs=3, metavar=("SPEC", "OVERRIDES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        return bare_loop(Path(args.bare[0]), Path(args.bare[1]))
    if args.interleaved_run:
        spec_path, overrides_path, out = map(Path, args.interleaved_run)
        times = interleaved(json.loads(overrides_path.read_text()), json.loads(spec_path.read_text()), out.parent)
        return out.write_text(json.dumps(times))

    began = time.monotonic()
    os.environ.setdefault("WANDB_MODE", "offline")
    pairs = args.pairs
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        steps = args.steps
        overrides = ["+override=constant", f"trainer.steps={steps}", *args.set]
        spec, facts = prepare(overrides, tmp)
        (tmp / "spec.json").write_text(json.dumps(spec))
        runs: list[dict] = []
        for pair in range(pairs):
            run: dict = {}
            for side in (("bare", "tinker_exp") if pair % 2 == 0 else ("tinker_exp", "bare")):
                if side == "bare":
                    out = tmp / f"bare_{pair}.jsonl"
                    start, rows = timed([sys.executable, __file__, "--bare", str(tmp / "spec.json"), str(out)],
                                        lambda: [json.loads(line) for line in out.read_text().splitlines()])  # fmt: skip
                    rows = rows[:-1]
                    run["bare"] = (*figures(start, [r["time"] for r in rows]), [r["loss"] for r in rows])
                else:
                    run_dir = tmp / f"run_{pair}"
                    start, rows = timed([sys.executable, "-m", "tinker_exp", *overrides, f"hydra.run.dir={run_dir}"],
                                        lambda: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])  # fmt: skip
                    run["tinker_exp"] = (*figures(start, [r["time"] for r in rows]), [r["train/loss"] for r in rows])
                run.setdefault("first", side)
            runs.append(run)
            print(f"pair {pair + 1}/{pairs} done ({time.monotonic() - began:.0f} s)", file=sys.stderr)
        steps_interleaved = None
        if not args.no_interleaved:
            (tmp / "overrides.json").write_text(json.dumps(overrides))
            out = tmp / "interleaved.json"
            timed([sys.executable, __file__, "--interleaved-run", str(tmp / "spec.json"), str(tmp / "overrides.json"), str(out)],
                  lambda: None)  # fmt: skip
            steps_interleaved = json.loads(out.read_text())

    choice = facts["choice"]
    tokens = statistics.median(facts["tokens"])
    print(f"{'pair':6}{'first':>11}{'step ms: bare':>15}{'tinker_exp':>12}{'ratio':>8}"
          f"{'start to step 1 s: bare':>26}{'tinker_exp':>12}{'ratio':>8}")  # fmt: skip
    for i, run in enumerate(runs):
        (b_step, b_start, _), (o_step, o_start, _) = run["bare"], run["tinker_exp"]
        print(f"{i + 1:<6}{run['first']:>11}{b_step * 1e3:15.1f}{o_step * 1e3:12.1f}{o_step / b_step:8.3f}"
              f"{b_start:26.2f}{o_start:12.2f}{o_start / b_start:8.3f}")  # fmt: skip
    b_steps, o_steps = [r["bare"][0] for r in runs], [r["tinker_exp"][0] for r in runs]
    b_starts, o_starts = [r["bare"][1] for r in runs], [r["tinker_exp"][1] for r in runs]
    step_ratios = [o / b for o, b in zip(o_steps, b_steps)]
    start_ratios = [o / b for o, b in zip(o_starts, b_starts)]
    print(f"median step time:        bare {spread([s * 1e3 for s in b_steps], '.1f')} ms, tinker_exp "
          f"{spread([s * 1e3 for s in o_steps], '.1f')} ms; ratio {spread(step_ratios, '.3f')}")  # fmt: skip
    print(f"start to end of step 1:  bare {spread(b_starts, '.2f')} s, tinker_exp {spread(o_starts, '.2f')} s; "
          f"ratio {spread(start_ratios, '.3f')}")  # fmt: skip
    print(f"tokens/s (median step):  bare {tokens / statistics.median(b_steps):,.0f}, tinker_exp "
          f"{tokens / statistics.median(o_steps):,.0f} ({tokens:,.0f} tokens a step)")  # fmt: skip
    same = all(r["bare"][2] == r["tinker_exp"][2] for r in runs)
    gap = max(abs(a - b) for r in runs for a, b in zip(r["bare"][2], r["tinker_exp"][2]))
    print(f"losses of the two loops: {'bitwise equal' if same else f'max |difference| {gap:.2e}'}")
    if steps_interleaved:
        bare_steps, our_steps = steps_interleaved
        ratios = [o / b for b, o in zip(bare_steps, our_steps)]
        print(f"interleaved, one process ({len(ratios)} step pairs; median (quartiles)): bare {quartiles([b * 1e3 for b in bare_steps], '.1f')} ms, "
              f"tinker_exp {quartiles([o * 1e3 for o in our_steps], '.1f')} ms; per-step ratio {quartiles(ratios, '.3f')}, "
              f"ratio of medians {statistics.median(our_steps) / statistics.median(bare_steps):.3f}")  # fmt: skip
    print(f"({pairs} pairs of {steps} steps; {spec['num_workers']} worker(s), {choice.describe()}; "
          f"{spec['model_path']}; tinker_exp with W&B offline + JSONL{'; ' + ' '.join(args.set) if args.set else ''})")


if __name__ == "__main__":
    main()
