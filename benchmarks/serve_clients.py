"""Two tinker SDK clients on one `python -m tinker_exp.serve`: one after the other against both at once, each a slot
of the server's one LoRA group (docs/serve.md, "Several clients at once").

    .venv/bin/python benchmarks/serve_clients.py [--pairs 3] [--steps 10]

One server for the whole run (the tiny model, 2 CPU workers, its own Ray cluster, serve.slots=2), warmed by a first
client. Each client (its own ServiceClient, a rank-8 model, its own batch of 8 sequences and lr) runs `steps`
forward_backward + optim_step in one of two styles: **awaited** (each call's result awaited before the next is sent)
or **sent ahead** (its whole loop sent at once, the SDK's futures, then every result awaited: the server holds the
client's next calls while it trains, so the two clients' calls wait together and train in one cycle: their
forward_backwards packed, their optim_steps in one round trip). Per round, four ways in turn (the first rotating):
each style one after the other and at once; per way the wall time from the first create_model to the last client's
close. Then the medians, the paired ratios (at once / one after the other, per style), the server's cycles (its
request lines that say `in one cycle`), and each client's losses at once against alone: bitwise where nothing was
packed, else the largest relative difference (the packed bound: 1e-5).
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
STYLES = ("awaited", "sent ahead")


def client_run(who: str, tokens: list[list[int]], steps: int, ahead: bool = False) -> list[float]:
    """One client's loop: its model, `steps` forward_backward + optim_step (`ahead`: all sent before any result is
    awaited), its session closed; its losses."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient()
    try:
        client = service.create_lora_training_client(base_model="tiny-llama", rank=RANK).result()
        data = [datum(t) for t in (tokens if who == "a" else tokens[::-1])]
        adam = types.AdamParams(**{**ADAM, "learning_rate": LRS[who]})
        if ahead:
            sent = [(client.forward_backward(data, "cross_entropy"), client.optim_step(adam)) for _ in range(steps)]
            losses = [fb.result().metrics["loss:sum"] for fb, step in sent if step.result() is not None]
        else:
            losses = []
            for _ in range(steps):
                losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                client.optim_step(adam).result()
        return losses
    finally:
        service.close("success").result(timeout=60)


def both(tokens: list[list[int]], steps: int, at_once: bool, ahead: bool) -> tuple[float, dict[str, list[float]]]:
    losses: dict[str, list[float]] = {}
    start = time.perf_counter()
    if at_once:
        threads = [threading.Thread(target=lambda w=who: losses.__setitem__(w, client_run(w, tokens, steps, ahead))) for who in LRS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for who in LRS:
            losses[who] = client_run(who, tokens, steps, ahead)
    if set(losses) != set(LRS):
        raise SystemExit("a client failed (its traceback above)")
    return time.perf_counter() - start, losses


def largest_difference(got: dict[str, list[float]], alone: dict[str, list[float]]) -> float:
    return max(abs(x - y) / max(abs(x), abs(y)) if x != y else 0.0 for who in LRS for x, y in zip(got[who], alone[who], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    tokens = batch_tokens()
    ways = [(style, at_once) for style in STYLES for at_once in (False, True)]
    with running_server("serve.slots=2") as lines:
        client_run("a", tokens, 1)  # the group built, then kept warm for the pairs
        walls: dict[tuple[str, bool], list[float]] = {way: [] for way in ways}
        cycles: dict[tuple[str, bool], list[int]] = {way: [] for way in ways}
        differences: dict[str, float] = {style: 0.0 for style in STYLES}
        for pair in range(args.pairs):
            got = {}
            for way in ways[pair % len(ways):] + ways[: pair % len(ways)]:
                seen = len(lines)
                wall, got[way] = both(tokens, args.steps, way[1], way[0] == "sent ahead")
                walls[way].append(wall)
                cycles[way].append(sum("in one cycle" in line for line in lines[seen:]))
            for style in STYLES:
                differences[style] = max(differences[style], largest_difference(got[(style, True)], got[(style, False)]))
            print(f"pair {pair}: " + "; ".join(f"{style} {'at once' if at_once else 'one after the other'} "
                                               f"{walls[(style, at_once)][-1]:.2f} s ({cycles[(style, at_once)][-1]} calls in cycles)"
                                               for style, at_once in ways))
    for (style, at_once), values in walls.items():
        print(f"{style}, {'at once' if at_once else 'one after the other'}: median {statistics.median(values):.2f} s "
              f"({min(values):.2f}..{max(values):.2f}), {2 * args.steps / statistics.median(values):.2f} client steps/s, "
              f"calls in cycles {cycles[(style, at_once)]} of {4 * args.steps} a round")
    for style in STYLES:
        ratios = [b / a for a, b in zip(walls[(style, False)], walls[(style, True)])]
        print(f"{style}: at once / one after the other: median {statistics.median(ratios):.3f} ({min(ratios):.3f}.."
              f"{max(ratios):.3f}); every client's losses at once against alone: largest relative difference "
              f"{differences[style]:.2e}")


if __name__ == "__main__":
    main()
