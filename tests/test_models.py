"""model.path: any local Hugging Face causal LM or a hub id from the cache, checked before any worker starts; a
second architecture (a tiny Qwen2 built here, not by tinker_exp) trains on the real 2-worker path."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import job_json, read_jsonl, run_cli
from models import build_tiny_qwen2, into_hub_cache
from tinker_exp.config import resolve_model_path
from tinker_exp.errors import ConfigError

REPO_ID = "tinkerexp-test/tiny-qwen2"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="module")
def hub_cache(qwen2_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_hub")
    into_hub_cache(qwen2_dir, cache, REPO_ID)
    return cache


def test_a_local_model_dir_is_checked_without_loading_it(qwen2_dir, tmp_path):
    assert resolve_model_path(str(qwen2_dir), download=False) == qwen2_dir
    broken = tmp_path / "broken"
    shutil.copytree(qwen2_dir, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(ConfigError, match=r"model.path: '.*broken' has no tokenizer"):
        resolve_model_path(str(broken), download=False)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"has no weights"):
        resolve_model_path(str(broken), download=False)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen2ForSequenceClassification"]}))
    with pytest.raises(ConfigError, match=r"is not a causal LM \(architectures: \['Qwen2ForSequenceClassification'\]\)"):
        resolve_model_path(str(broken), download=False)
    with pytest.raises(ConfigError, match=r"neither a model dir nor a Hugging Face hub id"):
        resolve_model_path(str(tmp_path / "missing"), download=False)


def test_a_hub_id_not_in_the_cache_fails_before_ray_naming_the_id_and_the_cache(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "RAY_ADDRESS": None}
    result = run_cli("model.path=nobody-here/no-model", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"tinker_exp: config error: model.path: 'nobody-here/no-model' is not in the local Hugging Face cache "
        f"({tmp_path / 'empty'}; HF_HUB_CACHE or HF_HOME set it) and could not be downloaded (LocalEntryNotFoundError)"
    )
    assert not (tmp_path / "run" / "workers.log").exists()  # no worker was started
    offline = run_cli("model.path=nobody-here/no-model", "dry_run=true", f"hydra.run.dir={tmp_path / 'dry'}",
                      env={**env, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert offline.returncode == 2 and "and HF_HUB_OFFLINE is set" in offline.stderr


def test_chat_data_for_a_model_without_a_chat_template_fails_the_dry_run(qwen2_dir, tmp_path):
    """Known from the model's files: the dry run (no torch, no tokenizer loaded) finds it."""
    plain = tmp_path / "no-template"
    shutil.copytree(qwen2_dir, plain)
    tokenizer_config = json.loads((plain / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    result = run_cli(f"model.path={plain}", "data=tiny_chat", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("tinker_exp: config error: data.path: ") and f"messages rows need a chat template, and the tokenizer of {plain} has none" in line
    assert run_cli(f"model.path={qwen2_dir}", "data=tiny_chat", "dry_run=true", f"hydra.run.dir={tmp_path / 'ok'}").returncode == 0


def test_a_second_architecture_from_the_hub_cache_trains_chat_data_with_lora(hub_cache, ray_address, tmp_path):
    """A Qwen2 (GQA, no BOS token, its own ChatML template) found offline by its hub id, on the shipped chat set,
    with LoRA: model, data and lora compose; it trains, every step applied == requested, the adapter exported."""
    run_dir = tmp_path / "run"
    result = run_cli(
        f"model.path={REPO_ID}", "data=tiny_chat", "lora=r8", "trainer.steps=3", "logger=none", "+override.lr=1e-2", "backend.num_workers=1",
        f"hydra.run.dir={run_dir}",
        env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ray_address}, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [row["train/step"] for row in rows] == [0, 1, 2]
    assert all(row["applied/lr"] == row["requested/lr"] == 1e-2 for row in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["base_model_name_or_path"]
    assert "patch for Qwen2ForCausalLM" in (run_dir / "workers.log").read_text()  # verl built the model found in the cache
    assert job_json(run_dir)["overrides"][0] == f"model.path={REPO_ID}"


def test_a_top_level_hub_id_is_a_hub_id_not_a_missing_dir(tmp_path):
    """`model.path=gpt2` (no org/): what a hub id gets, looked up in the cache (offline here: nothing downloaded),
    not "neither a model dir nor a hub id"; a dry run of an id not cached yet passes (a run fetches it)."""
    from tinker_exp.config.validate import is_hub_id

    assert all(is_hub_id(name) for name in ("gpt2", "distilgpt2", "Qwen/Qwen2.5-0.5B", "openai-community/gpt2"))
    assert not any(is_hub_id(name) for name in ("/abs/gpt2", "./gpt2", "~/m", "a/b/c", "a..b", "-x", "org/"))
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "RAY_ADDRESS": None, "HF_HUB_OFFLINE": "1"}
    offline = run_cli("model.path=gpt2", "dry_run=true", f"hydra.run.dir={tmp_path / 'dry'}", env=env)
    assert offline.returncode == 2 and offline.stderr.strip().splitlines() == [
        f"tinker_exp: config error: model.path: 'gpt2' is not in the local Hugging Face cache ({tmp_path / 'empty'}; "
        "HF_HUB_CACHE or HF_HOME set it) and HF_HUB_OFFLINE is set"
    ], offline.stderr
    dry = run_cli("model.path=gpt2", "dry_run=true", f"hydra.run.dir={tmp_path / 'dry2'}", env={**env, "HF_HUB_OFFLINE": None})
    assert dry.returncode == 0, dry.stderr  # not cached: a dry run does not download, and it is a hub id
