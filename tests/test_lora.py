"""LoRA (lora=r8) on the real path: verl's TinkerTrainingWorker with peft adapters on 2 Ray CPU gloo workers.

One probed run reads the live workers' weights after start-up and after training; its exported adapter is
loaded with peft in this process; a copy of its run dir, its newest checkpoint removed, is resumed (probed too);
it is the trunk of a LoRA branch.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

import pytest

from helpers import compose, read_jsonl, run_cli
from tinker_exp import config
from tinker_exp.place import GivenWorkers
from tinker_exp.run import ADAPTER, run
from tinker_exp.train.data import dataset_rows

STEPS = 4
# lr 5e-3 (above the optimizer's 1e-3): the adapter moves the log-probs well past fp32 noise in 4 steps.
COMMON = ["lora=r8", f"trainer.steps={STEPS}", "checkpoint.every_steps=2", "logger=none", "+override.lr=5e-3"]
FIXED = 4
"""The fixed input: the first training examples, scored by the trained worker and by peft here."""


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def base_name(name: str) -> str:
    """peft's name of a base weight -> the model file's (verl's normalize_peft_param_name)."""
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def probed(fixed: list, seen: dict):
    """A start for run()'s `GivenWorkers`: verl's workers, read at start-up (after reset, before any checkpoint is loaded)
    and, once the adapter is exported, before they are freed: every weight's digest, log-probs on `fixed`."""
    from tinker_exp.runtime.workers import TinkerWorkers

    class ProbedWorkers(TinkerWorkers):
        def worker_class(self):
            base = super().worker_class()
            from verl.single_controller.base.decorator import Dispatch, register

            class ProbedWorker(base):  # a local class: Ray ships it to the workers by value
                @register(dispatch_mode=Dispatch.ONE_TO_ALL)
                def weight_digests(self):
                    import hashlib

                    from torch.distributed.tensor import DTensor

                    digests = {}  # (this test module's own `digest` is not importable on the workers)
                    for name, tensor in self.engine.module.state_dict().items():  # the same order on every rank
                        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # collective
                        digests[name] = hashlib.sha256(full.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
                    return digests

            return ProbedWorker

        def shutdown(self, timeout_s: float = 10.0) -> None:
            if (self.run_dir / ADAPTER).exists():  # the run finished: read what it trained
                seen["end"] = self.group.weight_digests()[0]
                log_probs = self.group.infer_batch(self._batch(fixed)).get()["log_probs"]
                seen["log_probs"] = [row.tolist() for row in log_probs.unbind()]
            super().shutdown(timeout_s)

    def start(cfg, plan, model_path, run_dir):
        workers = ProbedWorkers(
            cfg.backend, cfg.optimizer, cfg.trainer, str(model_path), plan.optimizer_values, "cpu", lora=cfg.lora
        )
        workers.run_dir = run_dir
        seen["start"] = workers.group.weight_digests()[0]
        return workers

    return start


@pytest.fixture(scope="module")
def lora_run(ray_address, tmp_path_factory):
    """A 4-step LoRA run on probed workers."""
    from tinker_exp.runtime.inputs import load_examples, model_dir

    cfg = config.load(compose(*COMMON))
    model_path = model_dir(cfg.model)
    fixed = load_examples(cfg.data, model_path, dataset_rows(cfg.data)[0], [])[0].examples[:FIXED]
    seen: dict = {}
    run_dir = tmp_path_factory.mktemp("lora_run")
    last = run(compose(*COMMON), run_dir, place=GivenWorkers(probed(fixed, seen)))
    seen["returned"] = time.time()
    return run_dir, last, model_path, fixed, seen


def test_only_the_adapters_train(lora_run):
    """The base weights the trained workers hold are the model dir's, bit for bit; every adapter tensor moved."""
    from safetensors import safe_open

    run_dir, last, model_path, _, seen = lora_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == list(range(STEPS)) and rows[-1] == last
    assert [row["applied/lr"] for row in rows] == [5e-3] * STEPS  # one group, frozen base included: read back
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] and "val/loss" in last

    start, end = seen["start"], seen["end"]
    adapters = sorted(name for name in end if "lora_" in name)
    base = {base_name(name): value for name, value in end.items() if "lora_" not in name}
    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        on_disk = {name: digest(f.get_tensor(name)) for name in f.keys()}
    assert len(on_disk) == 20 and on_disk.items() <= base.items()  # every weight of the file, unchanged
    assert adapters and all(start[name] != end[name] for name in adapters), [n for n in adapters if start[n] == end[n]]


def test_the_run_ends_within_seconds_of_its_last_checkpoint(lora_run):
    """The end of a run, in order and bounded: the last step's row (its final evaluation in it), its checkpoint,
    the adapter's export, the workers freed (here with the probe's reads), report.png, run() returning; from the
    checkpoint to the return a few seconds, not the minute a stuck end would take (issue 46: a GPU LoRA run had not
    ended 8 s after its last step). Timestamps from the files themselves (mtimes) and the rows' `time`."""
    run_dir, last, *_, seen = lora_run

    def written(folder: Path) -> float:
        return max(path.stat().st_mtime for path in folder.rglob("*") if path.is_file())

    step = read_jsonl(run_dir / "metrics.jsonl")[-1]["time"]
    checkpoint = written(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    adapter = written(run_dir / "adapter")
    report = (run_dir / "report.png").stat().st_mtime
    assert "val/loss" in last  # the final evaluation ran, before its row was written
    slack = 0.05  # file systems' mtime granularity against time.time()
    assert step - slack <= checkpoint <= adapter + slack <= report + 2 * slack <= seen["returned"] + 3 * slack
    assert seen["returned"] - checkpoint < 15, (step, checkpoint, adapter, report, seen["returned"])


def test_the_exported_adapter_loads_with_peft_and_scores_as_the_worker(lora_run):
    """<run dir>/adapter/ in peft's format: on the base model here (CPU, fp32), the same per-token log-probs."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tinker_exp.runtime import lora

    run_dir, _, model_path, fixed, seen = lora_run
    adapter = run_dir / ADAPTER
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not list(run_dir.glob(".*.partial"))
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        exported = sum(f.get_tensor(name).numel() for name in f.keys())
    cfg = config.load(compose(*COMMON))
    assert exported == lora.check(cfg.lora, model_path).trainable  # what the driver counted before launch

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), adapter)
    model.eval()

    def scored(example) -> torch.Tensor:
        """log p(token t+1 | tokens <= t), as verl's log_probs[t] (its last position has no next token)."""
        ids = torch.tensor([example.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        return torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]

    worker = [torch.tensor(row[:-1]) for row in seen["log_probs"]]
    adapted = [scored(example) for example in fixed]
    with model.disable_adapter():
        plain = [scored(example) for example in fixed]
    gap = max(float((w - a).abs().max()) for w, a in zip(worker, adapted))
    adapter_effect = min(float((a - p).abs().max()) for a, p in zip(adapted, plain))
    print(f"max |worker - peft| log-prob {gap:.2e}; adapter's effect {adapter_effect:.2e}")
    assert gap < 1e-5  # fp32, another attention kernel and summation order
    assert adapter_effect > 1e-3  # the comparison is not vacuous: without the adapter the scores differ


def test_a_resumed_lora_run_continues_bitwise(lora_run, tmp_path):
    """The run dir as if killed after step 3, before its last save: the same command continues from the
    adapter-only checkpoint at step 2 (the frozen base rebuilt from the model dir) exactly as the run went on."""
    import torch
    from safetensors.torch import load_file

    run_dir, _, _, fixed, seen = lora_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    shutil.rmtree(resumed / ADAPTER)
    checkpoint = resumed / "checkpoints" / "step_00000002" / "workers"
    shards = [torch.load(p, weights_only=False) for p in sorted(checkpoint.glob("model_world_size_2_rank_*.pt"))]
    assert shards and all(shard and all("lora_" in name for name in shard) for shard in shards)  # adapters only

    again: dict = {}
    run(compose(*COMMON), resumed, place=GivenWorkers(probed(fixed, again)))
    assert again["start"] == seen["start"]  # the adapters' random init is seeded (trainer.seed): runs reproduce
    keys = ("train/step", "train/loss", "train/grad_norm", "applied/lr", "val/loss")
    want = [[row.get(k) for k in keys] for row in read_jsonl(run_dir / "metrics.jsonl")]
    assert [[row.get(k) for k in keys] for row in read_jsonl(resumed / "metrics.jsonl")] == want
    assert again["end"] == seen["end"] and again["log_probs"] == seen["log_probs"]  # every weight, bitwise
    got, expected = (load_file(d / ADAPTER / "adapter_model.safetensors") for d in (resumed, run_dir))
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_lora_branch_starts_from_the_trunks_adapters(lora_run, tmp_path):
    """A branch of the probed run at step 2 (its adapter-only checkpoint) with another lr and plan: its first step
    is the trunk's, bitwise (the same adapters and state), and its own lr acts from its first update on."""
    trunk = lora_run[0]
    branch = [arg for arg in COMMON if not arg.startswith(("+override.lr=", "trainer.steps="))]
    run(compose(*branch, "trainer.steps=6", "+override.lr=3e-3", f"branch.from={trunk}", "branch.step=2"), tmp_path)
    rows, trunk_rows = read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(trunk / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == list(range(2, 6))
    assert rows[0]["applied/lr"] != trunk_rows[2]["applied/lr"]  # the lr sent differs ...
    assert (rows[0]["train/loss"], rows[0]["train/grad_norm"]) == (trunk_rows[2]["train/loss"], trunk_rows[2]["train/grad_norm"])
    assert [row["applied/lr"] for row in rows] == [3e-3] * 4
    assert rows[1]["train/loss"] != trunk_rows[3]["train/loss"]  # ... and acts from the branch's first update on


def test_full_fine_tuning_is_the_default_and_lora_one_word_away():
    from tinker_exp.runtime.lora import model_config_fields

    assert config.load(compose()).lora.rank == 0 and model_config_fields(config.load(compose()).lora) == {}
    assert model_config_fields(config.load(compose("lora=r8")).lora) == {
        "lora_rank": 8, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
    }  # fmt: skip
    r32 = config.load(compose("lora=r32", "lora.target_modules=[q_proj,v_proj]", "model.hidden_size=32")).lora
    assert (r32.rank, r32.alpha, r32.target_modules) == (32, 64, ["q_proj", "v_proj"])


def test_a_target_module_that_matches_nothing_stops_before_any_worker_starts(tmp_path):
    result = run_cli("lora=r8", "lora.target_modules=[q_proj,nope]", "logger=none", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]  # a first use builds the tiny model (its progress bar) first
    assert "Traceback" not in result.stderr
    assert line.startswith("tinker_exp: config error: lora.target_modules: 'nope' matches no module of "), line
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "workers.log").exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.exclude_modules=[q_proj,nope]"], "lora.exclude_modules: 'nope' matches no module of "),
        (["lora.target_modules=.*_nowhere"], "lora.target_modules='.*_nowhere', lora.exclude_modules=None: Target modules"),
        (["lora.exclude_modules=.*"], "lora.target_modules='all-linear', lora.exclude_modules='.*': All modules were"),
    ],
)
def test_targets_are_checked_by_peft_on_the_model_before_launch(overrides, message):
    """peft on the model's architecture (meta device): the check the workers would fail, without them."""
    from tinker_exp.errors import ConfigError
    from tinker_exp.runtime import lora
    from tinker_exp.runtime.inputs import model_dir

    cfg = config.load(compose("lora=r8", *overrides))
    with pytest.raises(ConfigError) as info:
        lora.check(cfg.lora, model_dir(cfg.model))
    assert str(info.value).startswith(message), str(info.value)
    assert lora.check(config.load(compose("lora=r8")).lora, model_dir(cfg.model)).trainable > 0
