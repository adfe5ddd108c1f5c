"""An RL command's mistakes: one line naming the key as typed, exit 2, before any worker starts, nothing written
(in-process through the CLI's entry, as tests/test_cli_errors.py; dry_run=true, so a check that only a real start
would make is not tested here)."""

from __future__ import annotations

import sys

import pytest

from helpers import run_main

REWARDS = '''
def boom(row, response):
    raise ValueError("no")


def text(row, response):
    return "x"


def nan(row, response):
    return float("nan")
'''
DIGITS = "tinker_exp/assets/digits_train.jsonl:1"
RL = ["env=digits", "loss=ppo"]
REFUSED = [
    (["loss=importance_sampling"], "config error: loss.name=importance_sampling needs an env to sample from (env=digits, "
     "env=arithmetic, or your own: env.prompts=FILE env.reward=package.module:function); without one, use loss=cross_entropy"),
    (["env=digits"], "config error: env=digits trains with an RL loss, not loss.name=cross_entropy: add "
     "loss=importance_sampling (or ppo, cispo, dro, gspo, stable_reinforce)"),
    (["env=nosuch", "loss=ppo"], "config error: env=nosuch: env has no option nosuch (options: arithmetic, digits)"),
    (["env=digits", "loss=nosuch"], "config error: loss=nosuch: loss has no option nosuch (options: cispo, cross_entropy, dro, gspo, "
     "importance_sampling, ppo, stable_reinforce)"),
    ([*RL, "rl.group_size=1"], "config error: rl.group_size: must be >= 2, got 1 (advantages compare the responses to one prompt)"),
    ([*RL, "rl.temperature=0"], "config error: rl.temperature: must be > 0 (and finite), got 0.0"),
    ([*RL, "env.max_new_tokens=0"], "config error: env.max_new_tokens: must be >= 1, got 0"),
    ([*RL, "rl.prompts_per_step=3", "rl.group_size=3"], "config error: rl.prompts_per_step=3 x rl.group_size=3 = 9 responses "
     "per step do not split over backend.num_workers=2 x backend.micro_batch_size=2 = 4: make prompts_per_step x group_size "
     "a multiple of 4, or change backend.micro_batch_size"),
    ([*RL, "env.reward=nosuch.mod:f"], "config error: env.reward: cannot import 'nosuch.mod' (ModuleNotFoundError: No module "
     "named 'nosuch'); the module must be importable where the run starts (a file in the current directory or an "
     "installed package)"),
    ([*RL, "env.reward=cli_error_rewards:boom"], f"reward error: env.reward=cli_error_rewards:boom: raised ValueError: no on env.prompts: {{repo}}/{DIGITS} (response '')"),
    ([*RL, "env.reward=cli_error_rewards:text"], f"reward error: env.reward=cli_error_rewards:text: returned 'x' (str), not a number, on env.prompts: {{repo}}/{DIGITS} (response '')"),
    ([*RL, "env.reward=cli_error_rewards:nan"], f"reward error: env.reward=cli_error_rewards:nan: returned nan, not a finite number, on env.prompts: {{repo}}/{DIGITS} (response '')"),
    ([*RL, "env.prompts=bad.jsonl"], "config error: env.prompts: bad.jsonl:2: 'prompt' must be a non-empty string, got no such "
     "field (fields: ['question'])"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", REFUSED, ids=[" ".join(args) for args, _ in REFUSED])
def test_a_bad_rl_input_is_one_line_exit_2_and_writes_nothing(monkeypatch, capsys, tmp_path, args, line):
    from helpers import REPO

    (tmp_path / "cli_error_rewards.py").write_text(REWARDS)
    monkeypatch.delitem(sys.modules, "cli_error_rewards", raising=False)  # imported from this test's dir
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"question": "x"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_main(monkeypatch, capsys, *args, f"hydra.run.dir={tmp_path / 'run'}", "dry_run=true")
    assert code == 2, err
    assert err.strip().splitlines() == [f"tinker_exp: {line.format(repo=REPO)}"], err
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, where, tokens", [
    (["env.max_new_tokens=100000"], f"{{repo}}/{DIGITS}", 100000),
    (["env.prompts=long.jsonl"], "long.jsonl:2", 8),  # its first row fits
], ids=["max_new_tokens", "a long prompt"])  # fmt: skip
def test_a_dry_run_refuses_a_prompt_and_max_new_tokens_longer_than_the_models_positions(monkeypatch, capsys, tmp_path, args, where, tokens):
    """As the run does once it has its sampler (assemble.rl_inputs), the dry run renders each prompt with the model's
    tokenizer and chat template (no worker, no weights) and refuses the first whose tokens plus env.max_new_tokens
    exceed the tiny model's 256 positions: one line naming the file and row, exit 2, nothing written."""
    from helpers import REPO

    (tmp_path / "long.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "' + "abc " * 3000 + '"}\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(monkeypatch, capsys, *RL, *args, f"hydra.run.dir={tmp_path / 'run'}", "dry_run=true")
    assert code == 2, err
    (line,) = err.strip().splitlines()
    head, _, rest = line.partition(" the prompt is ")
    assert head == f"tinker_exp: config error: env.prompts: {where.format(repo=REPO)}:"
    prompt_tokens = int(rest.split()[0])
    assert rest == (f"{prompt_tokens} tokens; with env.max_new_tokens={tokens} that is {prompt_tokens + tokens}, more than the "
                    "model's 256 positions: shorten the prompt or lower env.max_new_tokens")  # fmt: skip
    assert prompt_tokens + tokens > 256 and "Traceback" not in out + err and not (tmp_path / "run").exists()
