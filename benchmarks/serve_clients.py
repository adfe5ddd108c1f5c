"""Two tinker SDK clients on one `python -m tinker_exp.serve`: one after the other against both at once, each a slot
of the server's one LoRA group (docs/serve.md, "Several clients at once").

    .venv/bin/python benchmarks/serve_clients.py [--pairs 3] [--steps 10]

One server for the whole run (the tiny model, 2 CPU workers, its own Ray cluster, serve.slots=2), warmed by a first
client. Each pair runs both ways, the first alternating: the two clients (each its own ServiceClient, a rank-8 model,
its own batch of 8 sequences and lr) one after the other, then in two threads at once; per way the wall time from the
first create_model to the last client's close. Then the medians, the per-pair ratios (at once / one after the
other), and whether each client's losses at once were bitwise its losses alone (they must be).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import ADAM, RANK, batch_tokens, datum, running_server  # noqa: E402 (this folder's benchmark)

LRS = {"a": 1e-3, "b": 3e-4}


def client_run(who: str, tokens: list[list[int]], steps: int) -> list[float]:
    """One client's loop: its model, `steps` forward_backward + optim_step, its session closed; its losses."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient()
    try:
        client = service.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
        data = [datum(t) for t in (tokens if who == "a" else tokens[::-1])]
        losses = []
        for _ in range(steps):
            losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(types.AdamParams(**{**ADAM, "learning_rate": LRS[who]})).result()
        return losses
    finally:
        service.close("success").result(timeout=60)


def both(tokens: list[list[int]], steps: int, at_once: bool) -> tuple[float, dict[str, list[float]]]:
    losses: dict[str, list[float]] = {}
    start = time.perf_counter()
    if at_once:
        threads = [threading.Thread(target=lambda w=who: losses.__setitem__(w, client_run(w, tokens, steps))) for who in LRS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for who in LRS:
            losses[who] = client_run(who, tokens, steps)
    if set(losses) != set(LRS):
        raise SystemExit("a client failed (its traceback above)")
    return time.perf_counter() - start, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    tokens = batch_tokens()
    with running_server("serve.slots=2"):
        client_run("a", tokens, 1)  # the group built, then kept warm for the pairs
        walls: dict[str, list[float]] = {"one after the other": [], "at once": []}
        same = True
        for pair in range(args.pairs):
            ways = [False, True] if pair % 2 == 0 else [True, False]
            got = {}
            for at_once in ways:
                wall, losses = both(tokens, args.steps, at_once)
                got[at_once] = losses
                walls["at once" if at_once else "one after the other"].append(wall)
            same = same and got[True] == got[False]
            print(f"pair {pair}: one after the other {walls['one after the other'][-1]:.2f} s, at once "
                  f"{walls['at once'][-1]:.2f} s, ratio {walls['at once'][-1] / walls['one after the other'][-1]:.3f}; "
                  f"losses at once == alone: {got[True] == got[False]}")
    for way, values in walls.items():
        print(f"{way}: median {statistics.median(values):.2f} s ({min(values):.2f}..{max(values):.2f}), "
              f"{2 * args.steps / statistics.median(values):.2f} client steps/s")
    ratios = [b / a for a, b in zip(walls["one after the other"], walls["at once"])]
    print(f"at once / one after the other: median {statistics.median(ratios):.3f} ({min(ratios):.3f}.."
          f"{max(ratios):.3f}); every client's losses at once bitwise its losses alone: {same}")


if __name__ == "__main__":
    main()
