"""The server under load: CLIENTS tinker SDK clients at once, each sending REQUESTS requests (refused ones included),
against `python -m tinker_exp.serve` on 127.0.0.1 (its own Ray cluster, the tiny model, 2 CPU workers).

    .venv/bin/python benchmarks/serve_load.py [--clients 8] [--requests 50] [--timeout 900]

Each client is its own ServiceClient (its own session) in a thread. All ask for the model at once: one gets it (the
server serves one model at a time) and spends its requests training (forward_backward and optim_step by turns); the
others are refused the model (a 400, counted) and spend theirs on samples of the base model (asample, seeded,
4 tokens), a forward_backward on a model that is not theirs (a 400) and a create_model again (a 400 while the model is
held). Printed: the server process's memory (RSS) after the model is built and warmed up, and at the end; each
client's count of answers by outcome; 5xx answers (from the clients and from the server's own lines); and the rows of
the trained model's metrics.jsonl against its optim_steps that succeeded (no row lost or doubled). Bounded: every
request has a timeout, the whole run --timeout seconds; the server is stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KEY = "tml-serve-load-benchmark-0123456789"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def start(run_dir: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """The server on a free port (serve.port=0), its lines collected; its URL once it listens."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TINKER_API_KEY")}
    env.update(TINKER_EXP_API_KEY=KEY, WANDB_MODE="offline")
    process = subprocess.Popen([sys.executable, "-m", "tinker_exp.serve", "serve.port=0", f"serve.run_dir={run_dir}",
                                "logger=none"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if " serving " in line:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    if not listening.wait(600) or process.poll() is not None:
        raise SystemExit(f"the server did not start: {lines[-10:]}")
    url = re.search(r"on (http://\S+) ", next(line for line in lines if " serving " in line)).group(1)
    return process, url, lines


def rss_mib(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def client_run(index: int, requests: int, tokens: list[int], outcomes: Counter, trained: dict, lock: threading.Lock,
               deadline: float) -> None:
    import tinker
    from tinker import types

    service = tinker.ServiceClient()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    def ask(kind: str, call) -> object:
        try:
            value = call()
            outcome = "ok"
        except tinker.APIStatusError as e:
            value, outcome = None, str(e.status_code)
        except Exception as e:  # a timeout, a connection error: counted, never hidden
            value, outcome = None, type(e).__name__
        with lock:
            outcomes[(index, kind, outcome)] += 1
        return value

    sent = 1
    client = ask("create_model", lambda: service.create_lora_training_client(base_model="tiny-llama", rank=8).result(timeout=300))
    if client is not None:
        with lock:
            trained["model_id"] = client.get_info().model_id
        steps = 0
        while sent < requests and time.monotonic() < deadline:
            if sent % 2:
                ask("forward_backward", lambda: client.forward_backward([datum], "cross_entropy").result(timeout=120))
            else:
                if ask("optim_step", lambda: client.optim_step(types.AdamParams(**ADAM)).result(timeout=120)) is not None:
                    steps += 1
            sent += 1
        with lock:
            trained["steps"] = steps
    else:
        sampler = service.create_sampling_client(base_model="tiny-llama")
        prompt, params = types.ModelInput.from_ints(tokens[:4]), types.SamplingParams(max_tokens=4, seed=index)
        while sent < requests and time.monotonic() < deadline:
            kind = ("sample", "create_model", "sample", "forward_backward elsewhere")[sent % 4]
            if kind == "sample":
                ask(kind, lambda: sampler.sample(prompt, 1, params).result(timeout=120))
            elif kind == "create_model":
                ask(kind, lambda: service.create_lora_training_client(base_model="tiny-llama", rank=8).result(timeout=120))
            else:
                ask(kind, lambda: post_raw("forward_backward", b"\x0a\x03abc"))
            sent += 1
    service.close("success").result(timeout=60)


def post_raw(route: str, body: bytes) -> None:
    """A protobuf the server refuses (a model id it does not serve): raised as the SDK raises a refusal."""
    import httpx
    import tinker

    response = httpx.post(f"{os.environ['TINKER_BASE_URL']}/api/v1/{route}", content=body, timeout=60,
                          headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"})
    if response.status_code != 200:
        raise tinker.APIStatusError(response.text, response=response, body=response.text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir

    tokens = AutoTokenizer.from_pretrained(model_dir(ModelConfig())).encode("The cat sat on the mat, and the dog sat too.")
    with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
        run_dir = Path(tmp) / "run"
        process, url, lines = start(run_dir)
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY=KEY, TINKER_TELEMETRY="0")
        try:
            import tinker
            from tinker import types

            # warm-up: a model built and one step, a sample, then the model released: memory from here on
            service = tinker.ServiceClient()
            warm = service.create_lora_training_client(base_model="tiny-llama", rank=8).result(timeout=600)
            warm_datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
            warm.forward_backward([warm_datum], "cross_entropy").result(timeout=300)
            warm.optim_step(types.AdamParams(**ADAM)).result(timeout=300)
            service.create_sampling_client(base_model="tiny-llama").sample(
                types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=4, seed=0)).result(timeout=300)
            service.close("success").result(timeout=60)
            start_rss = rss_mib(process.pid)
            outcomes: Counter = Counter()
            trained: dict = {}
            lock = threading.Lock()
            deadline = time.monotonic() + args.timeout
            began = time.monotonic()
            threads = [threading.Thread(target=client_run, args=(i, args.requests, tokens, outcomes, trained, lock, deadline))
                       for i in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(max(deadline - time.monotonic(), 1.0) + 120)
            wall = time.monotonic() - began
            end_rss = rss_mib(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(180)
        sent = sum(outcomes.values())
        by_outcome = Counter()
        for (_, kind, outcome), count in outcomes.items():
            by_outcome[(kind, outcome)] += count
        server_5xx = [line for line in lines if re.search(r"refused \(5\d\d|: failed", line)]
        client_5xx = sum(count for (_, _, outcome), count in outcomes.items() if outcome.startswith("5"))
        rows = []
        if "model_id" in trained:
            rows = [json.loads(line) for line in
                    (run_dir / "models" / trained["model_id"].replace(":", "_") / "metrics.jsonl").read_text().splitlines()]
        print(f"{args.clients} clients x {args.requests} requests: {sent} sent in {wall:.1f} s")
        for (kind, outcome), count in sorted(by_outcome.items()):
            print(f"  {kind}: {outcome} x{count}")
        print(f"5xx: {client_5xx} answered, {len(server_5xx)} server lines {server_5xx[:3]}")
        print(f"rows: {len(rows)} in the trained model's metrics.jsonl, {trained.get('steps')} optim_steps ok; steps "
              f"{[r['train/step'] for r in rows] == list(range(len(rows)))} in order without a gap")
        print(f"server RSS: {start_rss:.1f} MiB after the warm-up, {end_rss:.1f} MiB at the end "
              f"({end_rss - start_rss:+.1f} MiB)")
        print(f"stopped: exit {code}; last line: {lines[-1] if lines else ''}")


if __name__ == "__main__":
    main()
