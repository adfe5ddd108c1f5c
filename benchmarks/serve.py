"""The server's per-step overhead: forward_backward + optim_step on the tiny model, through `python -m tinker_exp.serve`
driven by the tinker SDK, against the same calls on the same workers class (ServeWorkers) made in-process; and the
wire size of one step's forward_backward protobuf.

    .venv/bin/python benchmarks/serve.py [--pairs 3] [--steps 10]
    .venv/bin/python benchmarks/serve.py --against ../other-checkout [--pairs 6]   # this server against another's

Each pair runs both, in its own Ray cluster each time, the first of a pair alternating (one process each: the direct
loop here, the server in a subprocess with this process as its SDK client). Per run: the median step time (a step is
forward_backward then optim_step, both results awaited) after a first step left out (warm-up); then the medians over
pairs and the per-pair ratios. Batch: 8 sequences of the shipped SFT set's first rows, LoRA rank 8, AdamW lr 1e-3.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BATCH = 8
RANK = 8
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def batch_tokens() -> list[list[int]]:
    import json

    from transformers import AutoTokenizer

    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir(ModelConfig()))
    rows = [json.loads(line) for line in (REPO / "tinker_exp/assets/tiny_sft.jsonl").read_text().splitlines()[:BATCH]]
    return [tokenizer.encode(" ".join(str(v) for v in row.values()))[:96] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--against", type=Path, help="another checkout: its server against this one's, paired")
    args = parser.parse_args()
    tokens = batch_tokens()
    if args.against is not None:
        return against(args.against.resolve(), tokens, args.pairs, args.steps)
    print(f"wire: one step's forward_backward request {request_bytes(tokens)} bytes ({BATCH} sequences, "
          f"{sum(len(t) for t in tokens)} tokens)")
    pairs = []
    for pair in range(args.pairs):
        order = ("direct", "server") if pair % 2 == 0 else ("server", "direct")
        times = {name: median_step(name, tokens, args.steps) for name in order}
        pairs.append(times)
        print(f"pair {pair}: direct {times['direct'] * 1e3:.1f} ms, server {times['server'] * 1e3:.1f} ms, "
              f"ratio {times['server'] / times['direct']:.3f}")
    for name in ("direct", "server"):
        values = [p[name] * 1e3 for p in pairs]
        print(f"{name}: median step {statistics.median(values):.1f} ms ({min(values):.1f}..{max(values):.1f})")
    ratios = [p["server"] / p["direct"] for p in pairs]
    print(f"server / direct: median {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")


def against(other: Path, tokens: list[list[int]], pairs: int, steps: int) -> None:
    """This checkout's server against `other`'s (a checkout before a change, say), the same SDK client loop, the
    first of a pair alternating: each run's median step, then the medians and the per-pair ratios."""
    global REPO
    this, times = REPO, {"other": [], "this": []}
    for pair in range(pairs):
        for name in ("other", "this") if pair % 2 == 0 else ("this", "other"):
            REPO = other if name == "other" else this  # the server runs from this checkout (python -m, its cwd)
            times[name].append(statistics.median(server_steps(tokens, steps)[1:]) * 1e3)
        print(f"pair {pair}: {other} {times['other'][-1]:.1f} ms, this {times['this'][-1]:.1f} ms, "
              f"ratio {times['this'][-1] / times['other'][-1]:.3f}")
    REPO = this
    for name, values in times.items():
        print(f"{name}: median step {statistics.median(values):.1f} ms ({min(values):.1f}..{max(values):.1f})")
    ratios = [a / b for a, b in zip(times["this"], times["other"])]
    print(f"this / other: median {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")


def request_bytes(tokens: list[list[int]]) -> int:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(t) for t in tokens], loss_fn="cross_entropy"),
        model_id="s:train:0", seq_id=1)
    return len(forward_backward_request_to_proto(request).SerializeToString())


def datum(tokens: list[int]):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def median_step(name: str, tokens: list[list[int]], steps: int) -> float:
    times = (direct_steps if name == "direct" else server_steps)(tokens, steps)
    return statistics.median(times[1:])


def direct_steps(tokens: list[list[int]], steps: int) -> list[float]:
    import ray
    from hydra import compose, initialize_config_dir

    from tinker_exp import config
    from tinker_exp.optim import build_plan
    from tinker_exp.runtime.device import resolve
    from tinker_exp.runtime.inputs import model_dir
    from tinker_exp.runtime.serve_workers import Datum, ServeWorkers

    config.register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = config.load(compose(config_name="config", overrides=["logger=none", f"lora.rank={RANK}"]))
    plan = build_plan(ADAM, cfg.optimizer, 1)  # what the SDK sends: AdamParams(learning_rate=1e-3), its defaults
    workers = ServeWorkers(cfg.backend, cfg.optimizer, cfg.trainer, str(model_dir(cfg.model)), plan.optimizer_values,
                           resolve(cfg.backend), None, cfg.lora)
    workers.ready()
    data = [Datum(t, [0.0] + [1.0] * (len(t) - 1)) for t in tokens]
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            workers.forward_backward(data)
            workers.optimizer_step(plan[0])
            times.append(time.perf_counter() - start)
    finally:
        workers.shutdown()
        if ray.is_initialized():
            ray.shutdown()
    return times


@contextmanager
def running_server(*args: str) -> Iterator[list[str]]:
    """`python -m tinker_exp.serve` from REPO on a free port (its own Ray cluster, no W&B) with `args`, this process
    its SDK client (TINKER_BASE_URL and the key set) while within; stopped on the way out. Gives its terminal's lines
    (one per request), read as they come."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TINKER_BASE_URL": f"http://127.0.0.1:{port}", "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0"}
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory() as run_dir, open(Path(run_dir) / "server.stderr", "w+") as stderr:
        # The server's workers log to its stderr: kept in a file so that the figures stand alone, shown if it fails.
        process = subprocess.Popen([sys.executable, "-m", "tinker_exp.serve", f"serve.port={port}",
                                    f"serve.run_dir={run_dir}/run", "logger=none", *args], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=stderr, text=True)
        try:
            if "serving" not in process.stdout.readline():
                stderr.seek(0)
                raise SystemExit(f"the server did not start:\n{stderr.read()[-4000:]}")
            # its line per request: read as they come (a full pipe would stop the server)
            lines: list[str] = []
            threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
            os.environ.update({k: env[k] for k in ("TINKER_BASE_URL", "TINKER_API_KEY", "TINKER_TELEMETRY")})
            yield lines
        finally:
            process.terminate()
            process.wait(60)


def server_steps(tokens: list[list[int]], steps: int) -> list[float]:
    import tinker
    from tinker import types

    with running_server():
        service = tinker.ServiceClient()
        client = service.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
        data = [datum(t) for t in tokens]
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            client.forward_backward(data, "cross_entropy").result()
            client.optim_step(types.AdamParams(**ADAM)).result()
            times.append(time.perf_counter() - start)
        service.close("success").result(timeout=60)  # its heartbeats end with it, not 120 s after the server
        return times


if __name__ == "__main__":
    main()
