"""Where a run's time goes on a GPU (or, with --tiny --device cpu, the same code on CPU): start-up, a step, MFU.

One process, one Ray: tinker_exp's real loop (`tinker_exp.run.run`, every check and sink) on its worker group, then
the bare verl loop (benchmarks/overhead.py's: verl's TinkerTrainingWorker built with the same config, driven with
forward_backward + optimizer_step and nothing else) on the same model and batches. Progress lines as it goes
(`[  12.3 s] ...`), then:

- start-up: imports (torch, Ray, verl's worker modules), Ray, the worker group (actors asked for), the workers'
  processes up, model load (verl's reset: model, FSDP2, optimizer), the first step (kernels' first use, compile);
- a step (median over the steps after --warmup): forward_backward and optimizer_step, each as the driver waits for
  it and as the worker spends it (device synchronised on cuda), the difference being the Ray round trip
  (dispatch, pickling, the batch's transfer); the driver's own work between steps (checks, sinks, next batch);
- tokens/s, MFU = 6 x N x tokens / step time / peak (N every parameter once, the tied embedding/lm_head once; the
  attention's own score/value matmuls left out, shown apart as `with attention`) on two bases: the GPU's spec dense
  bf16 peak (SPEC_PEAK_TFLOPS, found from the device's name, or --peak-tflops; what published MFU figures divide
  by) and the matmul rate measured on this GPU once the loops are done (8192^3 bf16 products; on CPU, 1024^3 fp32
  ones); peak GPU memory (torch.cuda.max_memory_allocated on the worker);
- the ratio of tinker_exp's median step to the bare loop's, and whether their losses agree.

    python benchmarks/gpu.py                               # one GPU: Qwen2.5-1.5B's shape, 16 x 2048 = 32,768 tokens a step
    python benchmarks/gpu.py --set backend.micro_batch_tokens=0 --set backend.micro_batch_size=4   # another config
    python benchmarks/gpu.py --peak-tflops 312              # a GPU the table does not know (A100: 312 TFLOP/s bf16)
    python benchmarks/gpu.py --tiny --device cpu            # CI (tests/test_benchmarks.py): tiny shapes on CPU

The model (random weights, seed 0, tinker_exp's byte-level tokenizer) is built once and cached under
$TINKER_EXP_CACHE/models (on the GPU when there is one: ~10 s for 1.5B). Rows are synthetic text long enough that
every one is cut to --seq tokens. `--json PATH` writes every figure. Exit 1 unless both loops trained (finite
losses), applied == requested at every step, and every rank's model sits on its device.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0)  # fmt: skip
"""Qwen2.5-1.5B's shape (tied embeddings): 1.54 B parameters."""
SPEC_PEAK_TFLOPS = (
    ("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989), ("H200 NVL", 835), ("H200", 989), ("H20", 148),
    ("GH200", 989), ("B200", 2250), ("A100", 312), ("A800", 312), ("L40S", 362), ("L40", 181), ("L4", 121),
    ("A10", 125), ("RTX 4090", 165), ("RTX 6000 Ada", 365),
)
"""Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, by a part of the name torch gives
the device (`NVIDIA H100 80GB HBM3` is the SXM part); the first match counts, so the specific names come first."""


def spec_peak(gpu_name: str | None, asked: float | None) -> tuple[float | None, str]:
    """(TFLOP/s, where it comes from) of the spec basis: --peak-tflops, else the table's entry for the device's name,
    else None (MFU on this basis not stated)."""
    if asked:
        return asked, f"--peak-tflops {asked:g}"
    for part, tflops in SPEC_PEAK_TFLOPS:
        if gpu_name and part in gpu_name:
            return float(tflops), f"{part} spec, dense bf16"
    return None, f"no spec peak known for {gpu_name or 'this device'} (pass --peak-tflops)"


def measured_matmul_tflops(device: str) -> float:
    """The dense matmul rate this device reaches (the median of 5 timed products after 2 warm-up ones): 8192^3 in
    bf16 on cuda, 1024^3 in fp32 on cpu."""
    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    times = []
    for i in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * n**3 / statistics.median(times[2:]) / 1e12

BEGAN = time.monotonic()
from overhead import TINY_QWEN2 as TINY  # noqa: E402  (benchmarks/overhead.py: the CI shapes)


def say(message: str) -> None:
    print(f"[{time.monotonic() - BEGAN:7.1f} s] {message}", flush=True)


# --- model and data -----------------------------------------------------------------------------------------------
def build_model(shape: dict, cache: Path, dtype: str) -> tuple[Path, int]:
    """overhead.py's model (a Qwen2 of `shape`, random weights, cached; built on the GPU when there is one) and its
    parameter count, read from the weights file's header (tied: the shared matrix once)."""
    import torch

    from overhead import bench_model

    model = bench_model(shape, cache, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    return model, parameter_count(model)


def parameter_count(model: Path) -> int:
    """A model dir's parameters, read from its weights files' headers (a tied matrix once)."""
    from safetensors import safe_open

    n_params = 0
    for weights in sorted(model.glob("*.safetensors")):
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():
                n_params += math.prod(f.get_slice(name).get_shape())
    return n_params


def build_data(path: Path, rows: int, chars: int) -> Path:
    """Prompt/response rows of about `chars` characters each (the shipped rows strung together, shifted per row)."""
    shipped = [json.loads(line) for line in (REPO / "tinker_exp/assets/tiny_sft.jsonl").read_text().splitlines() if line.strip()]
    with open(path, "w") as f:
        for i in range(rows):
            parts, size, j = [], 0, i
            while size < chars:
                row = shipped[j % len(shipped)]
                parts.append(f"{row['prompt']} {row['response']}")
                size += len(parts[-1]) + 1
                j += 7
            f.write(json.dumps({"prompt": shipped[i % len(shipped)]["prompt"], "response": "\n".join(parts)}) + "\n")
    return path


# --- the timed workers --------------------------------------------------------------------------------------------
def timed_workers_class():
    """TinkerWorkers whose ranks record when they start, load the model and spend each call (device synchronised),
    and whose driver records when each call returns. Only timestamps are added: the calls are tinker_exp's."""
    from tinker_exp.runtime.workers import TinkerWorkers, _loss
    from tinker_exp.train.protocols import StepResult

    class TimedWorkers(TinkerWorkers):
        calls: list[dict]

        def worker_class(self) -> type:
            from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register

            base = super().worker_class()

            def sync() -> None:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()

            class TimedWorker(base):
                def __init__(self, config):
                    self.bench = {"init_start": time.time(), "calls": []}
                    base.__init__(self, config)
                    self.bench["init_end"] = time.time()

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def reset(self):
                    self.bench["reset_start"] = time.time()
                    out = base.reset(self)
                    sync()
                    self.bench["reset_end"] = time.time()
                    return out

                @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"), blocking=False)
                def forward_backward(self, data):
                    sync()
                    t = time.time()
                    out = base.forward_backward(self, data)
                    sync()
                    self.bench["calls"].append(("forward_backward", t, time.time()))
                    return out

                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def optimizer_step(self, optim_step_params=None):
                    sync()
                    t = time.time()
                    out = base.optimizer_step(self, optim_step_params)
                    sync()
                    self.bench["calls"].append(("optimizer_step", t, time.time()))
                    return out

            TimedWorker.__name__ = TimedWorker.__qualname__ = f"Timed{base.__name__}"
            return TimedWorker

        def train_step(self, examples, optim_step_params):
            # TinkerWorkers.train_step, with the driver's timestamps
            t0 = time.time()
            output = self.group.forward_backward(self._batch(examples)).get()
            t1 = time.time()
            per_rank = self.group.optimizer_step(optim_step_params=optim_step_params or None)
            t2 = time.time()
            self.calls.append({"start": t0, "forward_backward": t1, "optimizer_step": t2})
            say(f"  step {len(self.calls) - 1}: {t2 - t0:.3f} s (forward_backward {t1 - t0:.3f}, optimizer_step {t2 - t1:.3f})")
            grad_norm = next((float(r["grad_norm"]) for r in per_rank if "grad_norm" in r), float("nan"))
            return StepResult(loss=_loss(output), grad_norm=grad_norm, applied=[r["param_groups"] for r in per_rank])

        def shutdown(self, *args, **kwargs) -> None:
            try:  # the ranks' figures, before they go
                self.ranks = self.bench_figures() if self.group is not None else []
            finally:
                super().shutdown(*args, **kwargs)

        def bench_figures(self) -> list[dict]:
            """Every rank's timestamps and peak device memory."""
            import ray

            def read(worker) -> dict:
                import torch

                peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
                return {**worker.bench, "peak_memory_bytes": peak}

            return ray.get([w.__ray_call__.remote(read) for w in self.group.workers])

    return TimedWorkers


# --- figures ------------------------------------------------------------------------------------------------------
def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def step_split(calls: list[dict], rank0: list[tuple], warmup: int) -> dict:
    """Per-step figures from the driver's timestamps and rank 0's, medians over the steps after `warmup`."""
    worker = {"forward_backward": [], "optimizer_step": []}
    for name, t0, t1 in rank0:
        worker[name].append(t1 - t0)
    rows = []
    for i, call in enumerate(calls):
        row = {
            "forward_backward_s": call["forward_backward"] - call["start"],
            "optimizer_step_s": call["optimizer_step"] - call["forward_backward"],
            "worker_forward_backward_s": worker["forward_backward"][i] if i < len(worker["forward_backward"]) else None,
            "worker_optimizer_step_s": worker["optimizer_step"][i] if i < len(worker["optimizer_step"]) else None,
        }
        if i + 1 < len(calls):
            row["step_s"] = calls[i + 1]["start"] - call["start"]
            row["driver_s"] = calls[i + 1]["start"] - call["optimizer_step"]
        rows.append(row)
    timed = rows[warmup:] or rows
    out = {key: median([r[key] for r in timed if r.get(key) is not None]) for key in rows[0]} if rows else {}
    out["step_s"] = median([r["step_s"] for r in timed if "step_s" in r]) or out.get("forward_backward_s", 0) + out.get("optimizer_step_s", 0)
    out["driver_s"] = median([r["driver_s"] for r in timed if "driver_s" in r])
    for name in ("forward_backward", "optimizer_step"):
        if out.get(f"worker_{name}_s") is not None:
            out[f"{name}_round_trip_s"] = out[f"{name}_s"] - out[f"worker_{name}_s"]
    out["steps"] = len(timed)
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:8.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU, CI)")
    parser.add_argument("--device", default="cuda", help="backend.device")
    parser.add_argument("--precision", help="backend.precision (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--seq", type=int, help="tokens a sequence (default 2048; 64 with --tiny)")
    parser.add_argument("--rows", type=int, help="sequences a step (default 16; 4 with --tiny)")
    parser.add_argument("--steps", type=int, default=6, help="steps of each loop (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (default 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (both loops)")
    parser.add_argument("--no-bare", action="store_true", help="tinker_exp's loop only")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak in TFLOP/s (default: from its name)")
    args = parser.parse_args()
    tiny = args.tiny
    seq, rows = args.seq or (64 if tiny else 2048), args.rows or (4 if tiny else 16)
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    os.environ.setdefault("WANDB_MODE", "offline")
    figures: dict = {"args": vars(args), "seq": seq, "rows": rows}

    # --- start-up: imports ---
    say("imports: torch, Ray, verl's worker modules, tinker_exp")
    t = time.monotonic()
    import torch

    figures["import_torch_s"] = time.monotonic() - t
    t1 = time.monotonic()
    import ray

    figures["import_ray_s"] = time.monotonic() - t1
    t1 = time.monotonic()
    from tinker_exp.runtime.workers import platform_env, use_platform  # before verl: its platform plugin

    device = "cpu" if args.device == "cpu" else "cuda"
    use_platform(device)
    import verl.workers.engine_workers_tinker  # noqa: F401

    from tinker_exp.place import GivenWorkers

    from tinker_exp.run import run

    figures["import_verl_tinker_exp_s"] = time.monotonic() - t1
    figures["imports_s"] = time.monotonic() - t
    say(f"imports done: {figures['imports_s']:.1f} s (torch {figures['import_torch_s']:.1f}, Ray {figures['import_ray_s']:.1f}, "
        f"verl + tinker_exp {figures['import_verl_tinker_exp_s']:.1f}); torch {torch.__version__}")  # fmt: skip

    cache = Path(os.path.expanduser(os.environ.get("TINKER_EXP_CACHE", "~/.cache/tinker_exp")))
    t = time.monotonic()
    model, n_params = build_model(TINY if tiny else QWEN25_15B, cache, "float32" if tiny else "bfloat16")
    figures.update(n_params=n_params, model=str(model), model_build_s=time.monotonic() - t)
    say(f"model: {n_params / 1e9:.3f} B parameters ({'tiny' if tiny else 'Qwen2.5-1.5B shape'}), {figures['model_build_s']:.1f} s")

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data = build_data(tmp / "rows.jsonl", rows * max(args.steps, 1), chars=seq * 8)
        overrides = [
            f"model.path={model}", f"data.path={data}", f"data.max_length={seq}", "data.val_fraction=null",
            f"backend.device={args.device}", f"backend.precision={precision}", "backend.num_workers=1",
            f"trainer.batch_size={rows}", f"trainer.steps={args.steps}", "checkpoint.every_steps=0",
            "checkpoint.at_end=false", "logger=none", "+override=constant", *args.set,
        ]  # fmt: skip
        from overhead import BareGroup, prepare

        spec, facts = prepare(overrides, tmp)  # the config as the CLI composes it; the bare loop's batches
        choice = facts["choice"]
        tokens = statistics.median(facts["tokens"])
        from tinker_exp.runtime.device import throughput

        composed = _config(overrides)
        knobs = throughput(composed.backend, choice.device, spec["optimizer"], choice.attention)
        # LoRA: the frozen base has no weight gradients, so a token costs 4 x N (forward 2, activations' gradients 2)
        figures["flops_per_token_basis"] = "4 x N (LoRA: no weight gradients of the frozen base)" if composed.lora.rank else "6 x N"
        figures["lora_rank"] = composed.lora.rank
        figures.update(tokens_per_step=tokens, device=choice.describe(), throughput=knobs.describe())
        say(f"config: {choice.describe()}; {knobs.describe()}; {rows} x {seq} tokens = {tokens:,.0f} tokens a step")

        # --- start-up: Ray ---
        t = time.monotonic()
        env = {k: v for k, v in platform_env(choice.device).items() if k != "TMPDIR"}
        from tinker_exp.runtime.ray_cluster import start_ray

        address = os.environ.get("RAY_ADDRESS")
        start_ray(address, env)
        figures["ray_s"] = time.monotonic() - t
        say(f"Ray: {figures['ray_s']:.1f} s ({'joined ' + address if address else 'a local cluster started'})")

        # --- tinker_exp's loop ---
        from hydra import compose, initialize_config_dir

        from tinker_exp import config

        TimedWorkers = timed_workers_class()
        holder: dict = {}

        def start_workers(cfg, plan, model_path, run_dir):
            from tinker_exp.assemble import WORKERS_LOG
            from tinker_exp.runtime.worker_output import WorkerOutput

            t0 = time.time()  # as tinker_exp.assemble.verl_workers builds them
            made = TimedWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, choice,
                                WorkerOutput(run_dir / WORKERS_LOG, echo=cfg.verbose), cfg.lora)  # fmt: skip
            holder["group_asked"] = (t0, time.time())
            made.calls = []
            ready = made.ready

            def timed_ready() -> None:
                t0 = time.time()
                ready()
                holder["ready"] = (t0, time.time())
                say(f"tinker_exp's workers ready: {time.time() - holder['group_asked'][0]:.1f} s after the group was asked for")

            made.ready = timed_ready
            holder["workers"] = made
            return made

        config.register()
        with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
            dcfg = compose("config", overrides=overrides)
        say("tinker_exp's loop: starting its workers")
        run_start = time.time()
        row = run(dcfg, tmp / "run", place=GivenWorkers(start_workers))
        run_end = time.time()
        workers = holder["workers"]
        metrics = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        ranks = workers.ranks
        placement = getattr(workers, "placement", None)  # tinker_exp's own check of every rank's device (ready())
        rank0 = ranks[0]
        first = workers.calls[0]
        startup = {
            "imports_s": figures["imports_s"],
            "ray_s": figures["ray_s"],
            "worker_group_s": holder["group_asked"][1] - holder["group_asked"][0],
            "workers_up_s": rank0["init_end"] - holder["group_asked"][0],
            "model_load_s": rank0["reset_end"] - rank0["reset_start"],
            "ready_wait_s": holder["ready"][1] - holder["group_asked"][1],
            "first_step_s": first["optimizer_step"] - first["start"],
            "run_to_first_step_s": first["optimizer_step"] - run_start,
            "run_end_after_last_step_s": run_end - workers.calls[-1]["optimizer_step"],
        }
        split = step_split(workers.calls, rank0["calls"], args.warmup)
        figures.update(startup=startup, tinker_exp=split, placement=placement,
                       peak_memory_gib=None if rank0["peak_memory_bytes"] is None else rank0["peak_memory_bytes"] / 2**30)  # fmt: skip
        losses = [r["train/loss"] for r in metrics]
        figures["tinker_exp"]["losses"] = losses
        failures = [f"tinker_exp step {r['train/step']}: applied {k} != requested"
                    for r in metrics for k in (k.split("/", 1)[1] for k in r if k.startswith("requested/"))
                    if r[f"applied/{k}"] != r[f"requested/{k}"]]  # fmt: skip
        if not losses or not all(math.isfinite(x) for x in losses):
            failures.append(f"tinker_exp: losses not finite: {losses}")
        if placement is None:
            failures.append("tinker_exp: no placement (its check of every rank's device) after ready()")
        say(f"tinker_exp's loop done: {len(metrics)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; the run ended "
            f"{startup['run_end_after_last_step_s']:.1f} s after its last step")  # fmt: skip

        step = split["step_s"]
        gpu_name = torch.cuda.get_device_name(0) if choice.device == "cuda" and torch.cuda.is_available() else None
        peak_tflops, peak_basis = spec_peak(gpu_name, args.peak_tflops)
        figures.update(gpu=gpu_name, spec_peak_tflops=peak_tflops, spec_peak_basis=peak_basis)
        per_token = 4 if figures["flops_per_token_basis"].startswith("4") else 6
        mfu = per_token * n_params * tokens / step / (peak_tflops * 1e12) if peak_tflops else None
        peak = figures["peak_memory_gib"]
        say(f"tinker_exp: {step * 1e3:.1f} ms a step (median), {tokens / step:,.0f} tokens/s, MFU "
            f"{'-' if mfu is None else f'{mfu * 100:.1f} %'} ({peak_basis}), peak memory {'-' if peak is None else f'{peak:.1f} GiB'}")  # fmt: skip
        print("GPU_BENCH_PARTIAL " + json.dumps({"mfu_spec_peak": mfu, "spec_peak_basis": peak_basis, "tokens_per_s": tokens / step, "step_s": step, "split": split,
                                                 "peak_memory_gib": peak, "startup": startup, "device": choice.describe(),
                                                 "throughput": knobs.describe()}, default=str), flush=True)  # fmt: skip

        # --- the bare loop ---
        if not args.no_bare:
            say("the bare verl loop: starting its workers")
            t = time.time()
            bare = BareGroup(spec)
            bare_ready = time.time() - t
            say(f"bare workers ready: {bare_ready:.1f} s")
            times, bare_losses = [], []
            for step, (ids, masks) in enumerate(spec["batches"]):
                t0 = time.time()
                bare_losses.append(bare.step(ids, masks))
                times.append(time.time() - t0)
                say(f"  bare step {step}: {times[-1]:.3f} s")
            where = bare.placement()
            for w in bare.group.workers:
                ray.kill(w)
            timed = times[args.warmup:] or times
            figures["bare"] = {"step_s": median(timed), "ready_s": bare_ready, "losses": bare_losses, "workers": where}
            for rank, info in enumerate(where):
                want = f"cuda:{info.get('cuda_device')}" if choice.device == "cuda" else "cpu"
                if info["parameters"] != want:
                    failures.append(f"bare rank {rank}: parameters on {info['parameters']}, expected {want}")
            if not all(math.isfinite(x) for x in bare_losses):
                failures.append(f"bare: losses not finite: {bare_losses}")
    ray.shutdown()
    say("the matmul rate of this device (the workers are gone)")
    figures["matmul_tflops"] = measured_matmul_tflops(choice.device)

    # --- the report ---
    s = figures["tinker_exp"]
    step = s["step_s"]
    flops = (4 if figures["flops_per_token_basis"].startswith("4") else 6) * n_params * tokens
    shape = TINY if tiny else QWEN25_15B
    attention = 3 * 2 * 2 * shape["num_hidden_layers"] * shape["hidden_size"] * (seq / 2) * tokens
    bases = {"spec_peak": figures["spec_peak_tflops"], "measured_matmul": figures["matmul_tflops"]}
    figures.update(tokens_per_s=tokens / step, model_tflops_per_s=flops / step / 1e12)
    for basis, tflops in bases.items():
        figures[f"mfu_{basis}"] = flops / step / (tflops * 1e12) if tflops else None
        figures[f"mfu_{basis}_with_attention"] = (flops + attention) / step / (tflops * 1e12) if tflops else None
    print()
    print(f"GPU benchmark: {choice.describe()}; {knobs.describe()}")
    lora = f", LoRA rank {figures['lora_rank']} (the base frozen)" if figures["lora_rank"] else ""
    print(f"model: {n_params / 1e9:.3f} B parameters{lora}; {rows} x {seq} = {tokens:,.0f} tokens a step; {s['steps']} timed steps "
          f"after {args.warmup} warm-up; workers: {placement}")  # fmt: skip
    st = startup
    print(f"start-up:  imports {st['imports_s']:.1f} s, Ray {st['ray_s']:.1f} s, worker group {st['worker_group_s']:.1f} s, "
          f"workers up {st['workers_up_s']:.1f} s, model load {st['model_load_s']:.1f} s, first step {st['first_step_s']:.1f} s; "
          f"run start to first step done {st['run_to_first_step_s']:.1f} s")  # fmt: skip
    print(f"step:      {ms(step)} (median); forward_backward {ms(s['forward_backward_s'])} (worker {ms(s['worker_forward_backward_s'])}, "
          f"Ray round trip {ms(s.get('forward_backward_round_trip_s'))}); optimizer_step {ms(s['optimizer_step_s'])} "
          f"(worker {ms(s['worker_optimizer_step_s'])}, Ray round trip {ms(s.get('optimizer_step_round_trip_s'))}); "
          f"driver's own work {ms(s['driver_s'])}")  # fmt: skip
    print(f"tokens/s:  {figures['tokens_per_s']:,.0f}; {figures['model_tflops_per_s']:.1f} TFLOP/s")
    for basis, label in (("spec_peak", figures["spec_peak_basis"]), ("measured_matmul", "measured matmul rate")):
        mfu, with_attention, tflops = figures[f"mfu_{basis}"], figures[f"mfu_{basis}_with_attention"], bases[basis]
        percent = lambda x: "-" if x is None else f"{x * 100:.1f} %"  # noqa: E731
        print(f"MFU:       {percent(mfu)} on the {basis.replace('_', ' ')} ({'-' if tflops is None else f'{tflops:.4g} TFLOP/s'}: "
              f"{label}; {figures['flops_per_token_basis']} x tokens / step time, N = {n_params:,} parameters, each once; with attention "
              f"{percent(with_attention)})")  # fmt: skip
    peak = figures["peak_memory_gib"]
    print(f"memory:    peak {'-' if peak is None else f'{peak:.1f} GiB'} (torch.cuda.max_memory_allocated, rank 0)")
    print(f"run end:   {st['run_end_after_last_step_s']:.1f} s from the last step to run() returning")
    if "bare" in figures:
        b = figures["bare"]
        ratio = step / b["step_s"]
        figures["ratio_to_bare"] = ratio
        same = b["losses"] == figures["tinker_exp"]["losses"]
        gap = max((abs(x - y) for x, y in zip(b["losses"], figures["tinker_exp"]["losses"])), default=float("nan"))
        print(f"bare loop: {ms(b['step_s'])} a step (median), ready in {b['ready_s']:.1f} s; tinker_exp / bare = {ratio:.3f}; "
              f"losses {'bitwise equal' if same else f'max |difference| {gap:.2e}'}")  # fmt: skip
    print(f"total:     {time.monotonic() - BEGAN:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
    print("GPU_BENCH " + json.dumps({k: figures.get(k) for k in ("mfu_spec_peak", "mfu_measured_matmul", "flops_per_token_basis", "spec_peak_tflops", "spec_peak_basis",
                                                                 "matmul_tflops", "gpu", "tokens_per_s", "ratio_to_bare", "peak_memory_gib",
                                                                 "startup", "device", "throughput")}, default=str))  # fmt: skip
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("checks passed: losses finite, applied == requested, every rank on its device")
    return 0


def _config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from tinker_exp import config

    config.register()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        return config.load(compose("config", overrides=overrides))


if __name__ == "__main__":
    sys.exit(main())
