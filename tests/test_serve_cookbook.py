"""tinker-cookbook 0.6.1's own loops against `python -m tinker_exp.serve` (the tiny model, 2 CPU workers on the
suite's Ray cluster), with only the glue a user writes: a tokenizer registered for the served model's name (the hub
is out of reach), a local conversation file, and the cookbook's arithmetic env with its generic `role_colon`
renderer. Its supervised loop (`supervised.train`), its RL loop synchronous, and asynchronous with its `AsyncConfig`
default loss `stable_reinforce`, each run as a user runs it (a script, `asyncio.run(main(config))`).

The cookbook is installed with `pip install --no-deps tinker-cookbook==0.6.1` (Makefile): its requirement
`tml-renderers>=0.4.1` is not in our registry and is imported only for Inkling and Kimi models (docs/serve.md).
"""

from __future__ import annotations

import json

import pytest

from helpers import (PACKED_ADAPTER_RELATIVE, PACKED_RELATIVE, adapters_difference, read_jsonl, relative,
                     run_script, wait_until)
from test_serve import API_KEY, free_port, logprobs_of, model_rows, start_server

pytest.importorskip("tinker_cookbook", reason="make install puts tinker-cookbook 0.6.1 in (pip --no-deps)")

GLUE = '''
import asyncio, json, sys, time
from pathlib import Path

from transformers import AutoTokenizer
from tinker_cookbook.tokenizer_utils import register_tokenizer

from tinker_exp.config.schema import ModelConfig
from tinker_exp.runtime.inputs import model_dir

local = str(model_dir(ModelConfig()))
register_tokenizer("tiny-llama", lambda: AutoTokenizer.from_pretrained(local))  # the served name: not on the hub

base_url, out, loop = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
start = time.perf_counter()
if loop == "supervised":
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    conversations = out.parent / "conversations.jsonl"
    conversations.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {a}?"},
                                                              {"role": "assistant", "content": str(2 * a)}]}) + "\\n"
                                     for a in range(16)))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer="tiny-llama", renderer_name="role_colon",
                                            max_length=64, batch_size=4)
    config = train.Config(log_path=str(out), model_name="tiny-llama", recipe_name="sft", renderer_name="role_colon",
                          dataset_builder=FromConversationFileBuilder(file_path=str(conversations), common_config=common),
                          learning_rate=1e-3, lora_rank=8, base_url=base_url, save_every=2, eval_every=0, max_steps=4)
else:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    builder = ArithmeticDatasetBuilder(batch_size=2, model_name_for_tokenizer="tiny-llama", renderer_name="role_colon",
                                       n_batches=4, group_size=4, include_fewshot=False)
    off_policy = {"async_config": train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)} if loop == "async" else {}
    config = train.Config(learning_rate=1e-3, dataset_builder=builder, model_name="tiny-llama", recipe_name="rl",
                          max_tokens=8, log_path=str(out), renderer_name="role_colon", lora_rank=8, base_url=base_url,
                          eval_every=0, save_every=2, **off_policy)
asyncio.run(train.main(config))
print(f"wall {time.perf_counter() - start:.2f}")
'''


@pytest.fixture(scope="module")
def served(ray_address, tmp_path_factory):
    run_dir, port = tmp_path_factory.mktemp("serve_cookbook"), free_port()
    terminal = start_server(ray_address, run_dir, port)
    yield {"url": f"http://127.0.0.1:{port}", "run_dir": run_dir, "terminal": terminal}
    terminal.process.terminate()
    terminal.process.wait(60)


def run_loop(served, tmp_path, loop: str) -> tuple:
    """The user's script for `loop`; (its log dir, its metrics rows, the served model's own rows)."""
    script, out = tmp_path / "glue.py", tmp_path / loop
    script.write_text(GLUE)
    # forked from the CLI zygote, which has imported transformers and torch: the script's own start is its imports
    done = run_script(script, served["url"], str(out), loop, env={"TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0"},
                      timeout=600, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [row for row in read_jsonl(out / "metrics.jsonl")]
    checkpoints = read_jsonl(out / "checkpoints.jsonl")
    model_id = checkpoints[-1]["state_path"].removeprefix("tinker://").split("/")[0]
    return out, rows, model_rows(served, model_id), checkpoints


def test_the_cookbooks_supervised_loop_trains_on_a_local_conversation_file(served, tmp_path):
    out, rows, served_rows, checkpoints = run_loop(served, tmp_path, "supervised")
    losses = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert [c["name"] for c in checkpoints] == ["000002", "final"]  # save_every=2, then the last
    assert checkpoints[-1]["sampler_path"].endswith("/sampler_weights/final")
    # every step's lr (the cookbook's linear decay) reached the workers as sent
    assert [row["applied/lr"] for row in served_rows] == [row["requested/lr"] for row in served_rows]
    assert [row["requested/lr"] for row in served_rows] == pytest.approx([row["learning_rate"] for row in rows if "learning_rate" in row])


@pytest.mark.parametrize("loop", ["sync", "async"])
def test_the_cookbooks_rl_loop_on_its_arithmetic_env(served, tmp_path, loop):
    """4 batches of 2 groups x 4 samples. The async loop trains with its default loss, stable_reinforce (refused by
    the server before: `loss_fn: 'stable_reinforce' is not served`), on groups sampled up to a step behind. The tiny
    random model never answers, so every group's rewards are equal (-0.1, the format penalty): the steps run with
    zero advantages. The cookbook's own sampler/trainer KL (from the log-probs forward_backward returns) is ~1e-7."""
    out, rows, served_rows, checkpoints = run_loop(served, tmp_path, loop)
    trained = [row for row in rows if "optim/kl_sample_train_v1" in row]
    assert len(trained) == 4 and all(abs(row["optim/kl_sample_train_v1"]) < 1e-5 for row in trained)
    assert len(served_rows) == 4 and [row["applied/lr"] for row in served_rows] == [row["requested/lr"] for row in served_rows]
    names = [c["name"] for c in checkpoints]  # every 2 batches (the async loop also saves its start), then the last
    assert names[-3:] == ["000002", "000004", "final"] and set(names[:-3]) <= {"000000"}
    config = json.loads((out / "config.json").read_text())
    assert (config["async_config"] or {}).get("loss_fn") == ("stable_reinforce" if loop == "async" else None)
    # an RL loss's forward_backward runs alone on its slot (not packed): said once on the server's terminal
    loss = "stable_reinforce" if loop == "async" else "importance_sampling"
    said = served["terminal"].requests(f"forward_backward with loss {loss} runs alone on its slot (time-shared)")
    assert len(said) == 1 and said[0].endswith(": only cross_entropy calls pack"), said


def test_two_sdk_clients_train_at_once_on_two_slots_their_calls_packed_each_as_it_trains_alone(served, monkeypatch):
    """Two clients (each its own ServiceClient, rank-8 LoRA models, their own data and AdamParams), first each alone,
    then both at once in two threads. Each client sends its whole loop before awaiting any result (the SDK's
    futures: per step two forward_backward halves, accumulated, then its optim_step; then a forward), so the two
    models' calls wait on the server together: the work thread trains each cycle's two forward_backwards in one
    packed forward and backward, their forwards in one packed forward and their optim_steps in one round trip (its
    lines say which). Every loss, per-datum log-prob and grad norm of each client at once is within PACKED_RELATIVE
    of its run alone, the exported sampler adapter within PACKED_ADAPTER_RELATIVE; the server's log says which model
    holds which slot, and that a client's slot is freed when its session ends."""
    import threading

    import numpy as np
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from tinker_exp.config.schema import ModelConfig
    from tinker_exp.runtime.inputs import model_dir
    from test_serve import datum

    monkeypatch.setenv("TINKER_BASE_URL", served["url"])
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    tokenizer = AutoTokenizer.from_pretrained(model_dir(ModelConfig()))
    texts = {"a": ["The cat sat on the mat.", "Add 2 and 3: 5.", "Two plus two is four.", "Sky is blue."],
             "b": ["Spell dog: d-o-g.", "Red and blue make purple.", "One, two.", "Green grass grows."]}
    # each its own AdamParams per step; eps 1e-8 (Adam's update of a gradient far below eps magnifies a last-digit
    # difference of it: PACKED_ADAPTER_RELATIVE)
    plans = {who: [dict(learning_rate=lr, beta1=beta1, beta2=0.99, eps=1e-8, weight_decay=wd, grad_clip_norm=clip)
                   for lr, beta1, wd, clip in steps]
             for who, steps in {"a": [(5e-3, 0.9, 0.0, 0.0), (4e-3, 0.85, 0.01, 0.05), (3e-3, 0.8, 0.1, 1.0)],
                                "b": [(2e-3, 0.8, 0.1, 1.0), (3e-3, 0.9, 0.0, 0.0), (4e-3, 0.85, 0.01, 0.05)]}.items()}

    def train(who: str, barrier: threading.Barrier | None = None) -> dict:
        service = tinker.ServiceClient()
        try:
            client = service.create_lora_training_client(base_model="tiny-llama", rank=8).result()
            data = [datum(tokenizer.encode(text)) for text in texts[who]]
            if barrier is not None:  # both models exist: their loops start together
                barrier.wait(timeout=300)
            sent = []
            for params in plans[who]:  # the whole loop sent at once: the SDK numbers and orders it
                halves = [client.forward_backward(data[:2], "cross_entropy"), client.forward_backward(data[2:], "cross_entropy")]
                sent.append((halves, client.optim_step(types.AdamParams(**params))))
            forward = client.forward(data, "cross_entropy")
            steps = []
            for halves, step in sent:
                outputs = [half.result() for half in halves]
                steps.append(([o.metrics["loss:sum"] for o in outputs], np.concatenate([x for o in outputs for x in logprobs_of(o)]),
                              step.result().metrics["grad_norm"]))
            after = np.concatenate(logprobs_of(forward.result()))
            client.save_weights_for_sampler("final").result()
            model_id = client.get_info().model_id
            folder = served["run_dir"] / "checkpoints" / model_id.replace(":", "_") / "sampler_weights" / "final" / "adapter"
            return {"steps": steps, "after": after, "adapter": sorted(folder.glob("*.safetensors")), "model_id": model_id}
        finally:
            service.close("success").result(timeout=60)

    alone = {who: train(who) for who in ("a", "b")}
    barrier, at_once, failed = threading.Barrier(2), {}, []

    def in_thread(who: str) -> None:
        try:
            at_once[who] = train(who, barrier)
        except BaseException as e:  # noqa: BLE001 (the main thread asserts on it)
            failed.append(e)
            barrier.abort()

    threads = [threading.Thread(target=in_thread, args=(who,)) for who in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not failed and set(at_once) == {"a", "b"}, failed

    def close(got: list, want: list) -> float:
        """The largest relative difference of two lists of floats or of arrays (a datum's log-probs)."""
        got, want = [float(x) for each in got for x in np.ravel(each)], [float(x) for each in want for x in np.ravel(each)]
        assert len(got) == len(want)
        return max((relative(x, y) for x, y in zip(got, want)), default=0.0)

    worst = 0.0
    for who in ("a", "b"):
        assert len(at_once[who]["steps"]) == 3 and len(at_once[who]["adapter"]) == 1
        for (losses, logprobs, grad_norm), (want_losses, want_logprobs, want_grad_norm) in zip(at_once[who]["steps"], alone[who]["steps"]):
            worst = max(worst, close(losses, want_losses), close(logprobs, want_logprobs), relative(grad_norm, want_grad_norm))
        worst = max(worst, close(at_once[who]["after"], alone[who]["after"]))
        assert adapters_difference(at_once[who]["adapter"][0], alone[who]["adapter"][0]) <= PACKED_ADAPTER_RELATIVE, who
    assert worst <= PACKED_RELATIVE, worst
    assert adapters_difference(alone["a"]["adapter"][0], alone["b"]["adapter"][0]) > PACKED_ADAPTER_RELATIVE
    # the server's lines: the two models' calls trained in cycles of both (each such request's line says so)
    terminal = served["terminal"]
    for who in ("a", "b"):
        cycled = {method: terminal.requests(f"{method} model {at_once[who]['model_id']} seq ") for method in ("forward_backward", "optim_step")}
        assert all(len(lines) == 6 if method == "forward_backward" else len(lines) == 3 for method, lines in cycled.items()), cycled
        assert all(any(f"in one cycle with 1 other model's {method})" in line for line in lines) for method, lines in cycled.items()), cycled
        assert not [line for line in terminal.requests(f"model {alone[who]['model_id']} seq ") if "in one cycle" in line]
    log = terminal.err
    held = {who: [line for line in log if f"model {at_once[who]['model_id']} holds slot " in line] for who in ("a", "b")}
    assert all(len(lines) == 1 and "of 4 on the group of LoRA rank 8 (" in lines[0] for lines in held.values()), log[-20:]
    slot_of = {who: held[who][0].split(" holds slot ")[1].split(" ")[0] for who in ("a", "b")}
    assert slot_of["a"] != slot_of["b"], held
    freed = [f"tinker_exp.serve: model {at_once[who]['model_id']}'s slot {slot_of[who]} is free" for who in ("a", "b")]
    wait_until(lambda: all(line in log for line in freed), 120, f"{freed} never said: {log[-20:]}")  # after close()
