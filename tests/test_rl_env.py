"""The pure RL env (tinker_exp/rl): prompt rows and their checks, rewards loaded and called safely, the shipped
envs' rewards, group advantages (grpo checked against verl's own function), and the docs' own-reward example."""

import json
import math
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from helpers import REPO, compose, run_script
from omegaconf import OmegaConf
from tinker_exp.config.rl import Advantage, EnvConfig
from tinker_exp.errors import ConfigError, RewardError, one_line
from tinker_exp.rl.advantages import GRPO_EPSILON, group_advantages
from tinker_exp.rl.env import load_env
from tinker_exp.rl.envs import arithmetic_answer, digit_share
from tinker_exp.rl.prompts import PromptRow, check_prompt_lengths, read_prompt_rows
from tinker_exp.rl.rewards import check_reward, load_reward


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def rows_file(tmp_path: Path, *rows: object, name: str = "rows.jsonl") -> str:
    return write(tmp_path / name, "".join(json.dumps(row) + "\n" for row in rows))


def a_module(tmp_path: Path, monkeypatch, name: str, source: str) -> str:
    """A module of the user's, importable as `name` (the run's current dir is on sys.path the same way)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


# ---- prompt rows ----


@pytest.mark.parametrize("env", ["digits", "arithmetic"])
def test_the_shipped_envs_load_and_their_eval_prompts_are_held_out(env):
    cfg = OmegaConf.to_object(compose(f"env={env}", "loss=ppo")).env
    loaded = load_env(cfg)
    assert loaded.name == env and loaded.train and loaded.eval
    assert not {row.prompt for row in loaded.train} & {row.prompt for row in loaded.eval}
    assert all(row.where.startswith("env.prompts: ") for row in loaded.train)
    assert all(row.where.startswith("env.eval_prompts: ") for row in loaded.eval)


def test_the_shipped_prompt_files_are_what_the_script_writes():
    result = run_script(REPO / "scripts" / "make_rl_prompts.py", "--check")
    assert result.returncode == 0, result.stderr


def test_a_row_keeps_every_field_and_a_reward_cannot_change_it(tmp_path):
    [row] = read_prompt_rows(rows_file(tmp_path, {"prompt": "What is 2 + 2?", "answer": 4, "tags": ["a"]}), "env.prompts")
    assert row.prompt == "What is 2 + 2?" and row.record() == {"prompt": "What is 2 + 2?", "answer": 4, "tags": ["a"]}
    row.record()["tags"].append("changed")
    assert row.record()["tags"] == ["a"]
    assert row.where == f"env.prompts: {tmp_path / 'rows.jsonl'}:1"


BAD_ROWS = [
    ('{"prompt": "ok"}\n[1, 2]\n', ":2: expected a JSON object with a 'prompt' string, got list"),
    ('{"prompt": "ok"}\n{"question": "x"}\n', ":2: 'prompt' must be a non-empty string, got no such field (fields: ['question'])"),
    ('{"prompt": ""}\n', ":1: 'prompt' must be a non-empty string, got str '' (fields: ['prompt'])"),
    ('{"prompt": 3}\n', ":1: 'prompt' must be a non-empty string, got int 3 (fields: ['prompt'])"),
    ('{"prompt": "ok"}\n{"prompt": \n', ":2: not valid JSON (Expecting value)"),
]


@pytest.mark.parametrize("text, tail", BAD_ROWS)
def test_a_bad_prompt_row_is_named_by_file_and_line(tmp_path, text, tail):
    path = write(tmp_path / "rows.jsonl", text)
    with pytest.raises(ConfigError) as info:
        read_prompt_rows(path, "env.prompts")
    assert str(info.value) == f"env.prompts: {path}{tail}"


def test_an_empty_missing_or_blank_file_is_named(tmp_path):
    empty, blank = write(tmp_path / "empty.jsonl", ""), write(tmp_path / "blank.jsonl", "\n\n")
    for path, message in [(empty, f"env.eval_prompts: {empty} is empty"), (blank, f"env.eval_prompts: {blank} has no rows"),
                          (str(tmp_path / "nope.jsonl"), "env.eval_prompts: no such file: "),
                          (str(tmp_path), "is a directory, not a JSONL or Parquet file")]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            read_prompt_rows(path, "env.eval_prompts")
        assert str(info.value).startswith("env.eval_prompts: ") and message in str(info.value)


def test_a_prompt_that_does_not_fit_the_model_is_named():
    rows = [PromptRow("env.prompts: r.jsonl:1", "short", "{}"), PromptRow("env.prompts: r.jsonl:2", "long", "{}")]
    check_prompt_lengths(rows, [10, 248], max_new_tokens=8, positions=256)  # 248 + 8 = 256 fits exactly
    with pytest.raises(ConfigError) as info:
        check_prompt_lengths(rows, [10, 249], max_new_tokens=8, positions=256)
    assert str(info.value) == (
        "env.prompts: r.jsonl:2: the prompt is 249 tokens; with env.max_new_tokens=8 that is 257, more than the "
        "model's 256 positions: shorten the prompt or lower env.max_new_tokens"
    )


# ---- rewards ----

USER_REWARDS = """
import math
calls = []

def exact(row, response):
    return float(response.strip() == str(row["answer"]))

def says(row, response):
    return "yes"

def nan(row, response):
    return math.nan

def flag(row, response):
    return response == ""

def one_arg(row):
    return 0.0

NOT_A_FUNCTION = 3
"""


@pytest.mark.parametrize(
    "spec, message",
    [
        ("my_rewards", "env.reward: 'my_rewards' is not package.module:function"),
        ("my_rewards:exact:x", "env.reward: 'my_rewards:exact:x' is not package.module:function"),
        ("no_such_module_xyz:f", "env.reward: cannot import 'no_such_module_xyz' (ModuleNotFoundError: No module named "
         "'no_such_module_xyz'); the module must be importable where the run starts (a file in the current directory "
         "or an installed package)"),  # fmt: skip
        ("my_rewards:exakt", "env.reward: module 'my_rewards' has no 'exakt'; did you mean exact? (its callables: exact, "
         "flag, nan, one_arg, says)"),  # fmt: skip
        ("my_rewards:NOT_A_FUNCTION", "env.reward: my_rewards:NOT_A_FUNCTION is an int, not a function"),
        ("my_rewards:one_arg", "env.reward: my_rewards:one_arg must take (row, response); its signature is (row)"),
        ("broken_rewards:f", "env.reward: importing 'broken_rewards' raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_one_line(tmp_path, monkeypatch, spec, message):
    a_module(tmp_path, monkeypatch, "my_rewards", USER_REWARDS)
    a_module(tmp_path, monkeypatch, "broken_rewards", "x = 1 / 0\n")
    with pytest.raises(ConfigError) as info:
        load_reward(spec)
    assert str(info.value) == message


def test_a_reward_that_fails_on_a_row_names_the_row_and_the_response(tmp_path, monkeypatch):
    a_module(tmp_path, monkeypatch, "my_rewards", USER_REWARDS)
    path = rows_file(tmp_path, {"prompt": "2+2?", "answer": 4}, {"prompt": "3+3?"})
    good, bad = read_prompt_rows(path, "env.prompts")
    exact = load_reward("my_rewards:exact")
    assert exact(good, " 4 ") == 1.0 and exact(good, "5") == 0.0
    cases = [
        (exact, bad, "6", f"env.reward=my_rewards:exact: raised KeyError: 'answer' on env.prompts: {path}:2 (response '6')"),
        (load_reward("my_rewards:says"), good, "x" * 50,
         f"env.reward=my_rewards:says: returned 'yes' (str), not a number, on env.prompts: {path}:1 (response "
         f"'{'x' * 40}...')"),
        (load_reward("my_rewards:nan"), good, "", f"env.reward=my_rewards:nan: returned nan, not a finite number, on "
         f"env.prompts: {path}:1 (response '')"),
    ]  # fmt: skip
    for reward, row, response, message in cases:
        with pytest.raises(RewardError) as info:
            reward(row, response)
        assert str(info.value) == message
        assert one_line(info.value) == f"reward error: {message}" and info.value.exit_code == 2
        assert "\n" not in message


def test_a_bool_or_any_real_number_is_a_reward(tmp_path, monkeypatch):
    a_module(tmp_path, monkeypatch, "my_rewards", USER_REWARDS)
    [row] = read_prompt_rows(rows_file(tmp_path, {"prompt": "p"}), "env.prompts")
    flag = load_reward("my_rewards:flag")
    assert flag(row, "") == 1.0 and flag(row, "a") == 0.0 and type(flag(row, "")) is float


def test_before_any_worker_starts_the_reward_is_tried_on_every_row(tmp_path, monkeypatch):
    """load_env finds the one row the reward fails on (row 3 lacks the field it reads), with the empty response."""
    a_module(tmp_path, monkeypatch, "my_rewards", USER_REWARDS)
    train = rows_file(tmp_path, {"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2})
    held = rows_file(tmp_path, {"prompt": "c", "answer": 3}, {"prompt": "d", "answer": 4}, {"prompt": "e"}, name="held.jsonl")
    env = EnvConfig(prompts=train, eval_prompts=held, reward="my_rewards:exact")
    with pytest.raises(RewardError) as info:
        load_env(env)
    assert str(info.value) == f"env.reward=my_rewards:exact: raised KeyError: 'answer' on env.eval_prompts: {held}:3 (response '')"
    check_reward(load_reward("my_rewards:exact"), read_prompt_rows(train, "env.prompts"))  # the good rows pass


def test_a_checked_env_travels_to_a_pool_as_its_rows_and_its_rewards_spec(tmp_path, monkeypatch):
    """What a warm pool gets (place/lease.py pickles the checked env): the rows as read, the reward imported again by
    its spec (a `module:name` bound to a lambda too, which pickle cannot send by reference), not tried on the rows."""
    import pickle

    a_module(tmp_path, monkeypatch, "my_lambda_reward", "calls = []\nreward = lambda row, response: calls.append(row) or 0.5\n")
    env = load_env(EnvConfig(prompts=rows_file(tmp_path, {"prompt": "a"}, {"prompt": "b"}), reward="my_lambda_reward:reward"))
    module = sys.modules["my_lambda_reward"]
    assert len(module.calls) == 2  # load_env tried it on each row
    monkeypatch.delitem(sys.modules, "my_lambda_reward")  # as the pool forgets a run's modules: imported again on arrival
    arrived = pickle.loads(pickle.dumps(env))
    again = sys.modules["my_lambda_reward"]
    assert again is not module and again.calls == []  # imported, not tried on the rows
    assert arrived.train == env.train and arrived.reward.spec == "my_lambda_reward:reward"
    assert arrived.reward(arrived.train[0], "x") == 0.5 and len(again.calls) == 1


# ---- the shipped rewards ----


@pytest.mark.parametrize(
    "response, share",
    [("", 0.0), ("12345678", 1.0), ("a1", 0.5), (" 7", 0.5), ("no digits", 0.0), ("٣", 0.0), ("3.14", 0.75)],
)
def test_digit_share_counts_ascii_digit_characters(response, share):
    """An Arabic-Indic digit is a digit to str.isdigit but not an ASCII digit."""
    assert digit_share({"prompt": "p"}, response) == share


@pytest.mark.parametrize(
    "response, answer, reward",
    [("42", 42, 1.0), ("The answer is 42.", 42, 1.0), ("42 or 43", 42, 0.0), ("-75", -75, 1.0), ("75", -75, 0.0),
     ("", 3, 0.0), ("three", 3, 0.0), ("7 - 4 = 3", 3, 1.0)],  # fmt: skip
)
def test_arithmetic_reads_the_last_integer(response, answer, reward):
    assert arithmetic_answer({"prompt": "p", "answer": answer}, response) == reward


def test_the_arithmetic_answers_are_right():
    """Every shipped row's answer is the value of its expression (the reward is only as good as they are)."""
    for name in ("arithmetic_train.jsonl", "arithmetic_eval.jsonl"):
        for row in read_prompt_rows(f"builtin:{name}", "env.prompts"):
            a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", row.prompt).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == row.record()["answer"]


# ---- advantages ----


def test_mean_centred_is_reward_minus_the_group_mean():
    result = group_advantages([1.0, 0.0, 0.5, 0.5, 0.25, 0.75], 2, Advantage.mean_centred)
    assert result.advantages == [0.5, -0.5, 0.0, 0.0, -0.25, 0.25]
    assert result.degenerate == [1] and result.groups == 3 and not result.all_degenerate


def test_grpo_divides_by_the_unbiased_std_plus_epsilon():
    rewards = [0.0, 1.0, 1.0, 1.0]
    mean, std = 0.75, math.sqrt(float(Fraction(3, 4) * Fraction(3, 4) + 3 * Fraction(1, 4) ** 2) / 3)
    expected = [(r - mean) / (std + GRPO_EPSILON) for r in rewards]
    assert group_advantages(rewards, 4, "grpo").advantages == pytest.approx(expected, rel=1e-15)


def test_grpo_matches_verls_own_function():
    """verl's compute_grpo_outcome_advantage (float32) on random groups, one with equal rewards."""
    import random

    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rng = random.Random(0)
    group, groups = 8, 6
    rewards = [rng.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(group * groups)]
    rewards[group : 2 * group] = [0.5] * group
    ours = group_advantages(rewards, group, Advantage.grpo)
    token_rewards = torch.zeros(len(rewards), 3)
    token_rewards[:, -1] = torch.tensor(rewards)  # the outcome reward on the last token
    index = [str(i // group) for i in range(len(rewards))]
    verl, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(len(rewards), 3), index)
    assert verl[:, 0].tolist() == pytest.approx(ours.advantages, abs=1e-5)
    assert ours.degenerate == [1] and ours.advantages[group : 2 * group] == [0.0] * group


def test_a_step_whose_groups_are_all_degenerate_says_so():
    result = group_advantages([0.3] * 4 + [1.0] * 4, 4, Advantage.grpo)
    assert result.all_degenerate and result.degenerate == [0, 1] and result.advantages == [0.0] * 8


def test_rewards_that_are_not_whole_groups_are_a_bug():
    with pytest.raises(ValueError, match="5 rewards are not whole groups of 2"):
        group_advantages([0.0] * 5, 2, Advantage.grpo)


# ---- docs/rl.md's own-reward example, as written ----

DOCS = REPO / "docs" / "rl.md"


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block."""
    return [(lang, text) for lang, text in re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M)]


def test_the_docs_own_reward_example_runs_as_written(tmp_path, monkeypatch):
    """rows.jsonl and my_rewards.py from the page, the env loaded from the command's keys, the reward as described;
    then the page's quoted refusals are what a mistake in either file gives."""
    blocks = fenced_blocks(DOCS)
    rows = next(text for lang, text in blocks if lang == "json")
    source = next(text for lang, text in blocks if lang == "python" and "my_rewards.py" in text)
    command = next(text for lang, text in blocks if lang == "bash" and "env.reward=my_rewards:" in text).split()
    keys = dict(arg.split("=", 1) for arg in command if arg.startswith("env."))
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "rows.jsonl", rows)
    a_module(tmp_path, monkeypatch, "my_rewards", source)
    cfg = OmegaConf.to_object(compose(*(arg for arg in command if "=" in arg))).env
    assert (cfg.prompts, cfg.reward) == (keys["env.prompts"], keys["env.reward"])
    env = load_env(cfg)
    primes, evens = env.train
    assert [env.reward(primes, text) for text in ("7", "It is 13.", "4", "nine", "")] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert env.reward(evens, "4") == 0.0

    quoted = [line.removeprefix("tinker_exp: ") for lang, text in blocks if not lang for line in text.splitlines()
              if line.startswith("tinker_exp: ") and ("my_rewards" in line or "rows.jsonl:" in line)]  # fmt: skip
    mistakes = [
        lambda: write(tmp_path / "rows.jsonl", rows.replace('"prompt": "Name an even', '"question": "Name an even')),
        lambda: monkeypatch.setattr(cfg, "reward", "my_rewards:named_a_prme"),
        lambda: write(tmp_path / "rows.jsonl", rows + '{"prompt": "Name a prime below 5."}\n'),
    ]
    assert len(quoted) == len(mistakes)
    for line, mistake in zip(quoted, mistakes):
        write(tmp_path / "rows.jsonl", rows)
        cfg.reward = keys["env.reward"]
        mistake()
        with pytest.raises(ConfigError) as info:
            load_env(cfg)
        assert one_line(info.value) == line
