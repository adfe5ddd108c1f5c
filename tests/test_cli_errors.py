"""The override grammar's mistakes and typos: one line through the CLI's entry that says what to type; --help.

In-process through tinker_exp.main.main() with sys.argv set, as `python -m tinker_exp ARGS` runs it (a compose
error starts nothing, so no run dir is written); the help's example commands run as a user types them.
"""

import json
import shlex
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from helpers import CONF_DIR, run_cli, run_main
from tinker_exp.config import Config, LoraConfig, TrainerConfig
from tinker_exp.main import main
from tinker_exp.optim.convert import OVERRIDE_KEYS
from tinker_exp.optim.schedules import PARAMS


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def check_one_line(code: int, out: str, err: str, line: str) -> None:
    assert code == 2, err
    assert err.strip().splitlines() == [f"tinker_exp: config error: {line}"], err
    assert "Traceback" not in out + err and "HYDRA_FULL_ERROR" not in out + err


COSINE_TAKES = ", ".join([*PARAMS["cosine"], "total_steps"])
GRAMMAR = [
    (
        ["override=lr_cosine"],
        "override=lr_cosine: type +override=lr_cosine (the + adds the group, which is not in the defaults list on purpose)",
    ),
    (
        ["override=[lr_cosine,lr_wsd]"],  # as typed, not as Hydra's repr of the list
        "override=[lr_cosine,lr_wsd]: type +override=[lr_cosine,lr_wsd] "
        "(the + adds the group, which is not in the defaults list on purpose)",
    ),
    (
        ["+override=lr_cosine", "+override=lr_wsd"],
        "+override=lr_cosine, +override=lr_wsd: one +override flag only; compose presets in it: "
        "+override=[lr_cosine,lr_wsd] (a later file wins)",
    ),
    (
        ["override.lr=1e-3"],
        "override.lr=1e-3: no override is selected, so override.lr is new: type +override.lr=1e-3 "
        "(or select a preset first: +override=NAME)",
    ),
    (
        ["+override=lr_cosine", "override.lr.decay_steps=3"],
        f"override.lr.decay_steps: decay_steps is a parameter of wsd, not of cosine (override.lr.schedule); cosine takes {COSINE_TAKES}; "
        "to switch kinds: override.lr.schedule=wsd +override.lr.decay_steps=3",
    ),
    (
        ["+override=lr_wsd", "override.lr.stable_steps=3"],
        "override.lr.stable_steps=3: the selected override does not set stable_steps: type +override.lr.stable_steps=3 "
        "(the + adds a parameter the file does not set)",
    ),
    (
        ["+override=lr_cosine", "override.lr.warmup=3"],
        f"override.lr.warmup: cosine has no parameter warmup; did you mean warmup_steps? (cosine takes {COSINE_TAKES})",
    ),
    (
        ["+override=lr_cosine", "override.betas=[0.9,0.95]"],
        "override.betas=[0.9,0.95]: the selected override does not set betas: type +override.betas=[0.9,0.95] "
        "(the + adds a key the file does not set)",
    ),
    (
        ["+override=lr_cosine", "override.lrr=0.1"],
        f"override.lrr: not an override key; did you mean lr? (the keys: {', '.join(OVERRIDE_KEYS)})",
    ),
    (
        ["+override=lr_cosine", "+override.lr.min_ratio=0.2"],
        "+override.lr.min_ratio=0.2: override.lr.min_ratio is set already: type override.lr.min_ratio=0.2 "
        "(no +; ++override.lr.min_ratio=0.2 sets it either way)",
    ),
    (
        ["+override=lr_cosin"],
        f"+override=lr_cosin: override has no option lr_cosin; did you mean lr_cosine? (options: {', '.join(options('override'))})",
    ),
    (
        ["+override=[lr_wsd,lr_cosin]"],  # Hydra lists no options for a list: they are looked up
        f"+override=lr_cosin: override has no option lr_cosin; did you mean lr_cosine? (options: {', '.join(options('override'))})",
    ),
    (
        ["optimizer=adamww"],
        f"optimizer=adamww: optimizer has no option adamww; did you mean adamw? (options: {', '.join(options('optimizer'))})",
    ),
    (
        ["logger=[wandb,csvv]"],  # a list of the group's options, each looked up
        f"logger=csvv: logger has no option csvv; did you mean csv? (options: {', '.join(options('logger'))})",
    ),
    (
        ["logger=tensorbord"],
        f"logger=tensorbord: logger has no option tensorbord; did you mean tensorboard? (options: {', '.join(options('logger'))})",
    ),
    (
        ["data=tiny_chatt"],
        f"data=tiny_chatt: data has no option tiny_chatt; did you mean tiny_chat? (options: {', '.join(options('data'))})",
    ),
    (
        ["trainer.stpes=3"],
        "trainer.stpes: trainer has no key stpes; did you mean steps? "
        f"(trainer's keys: {', '.join(f.name for f in fields(TrainerConfig))})",
    ),
]


SWEEP_WITHOUT_M = [
    (
        ["+override=lr_cosine,lr_wsd"],
        "+override=lr_cosine,lr_wsd: a comma list is a sweep: add -m (one run per preset), "
        "or compose them in one run: +override=[lr_cosine,lr_wsd]",
    ),
    (
        ["optimizer.lr=1e-4,3e-4"],  # a number: no list to suggest (one would fail)
        "optimizer.lr=1e-4,3e-4: a comma list is a sweep: add -m (one run per value; optimizer.lr takes one value)",
    ),
    (
        ["+override.lr=1e-4,3e-4"],
        "+override.lr=1e-4,3e-4: a comma list is a sweep: add -m (one run per value; override.lr takes one value)",
    ),
    (
        ["optimizer.betas=0.9,0.95"],  # a key that takes a list
        "optimizer.betas=0.9,0.95: a comma list is a sweep: add -m (one run per value), "
        "or give a list: optimizer.betas=[0.9,0.95] (a string: optimizer.betas='0.9,0.95')",
    ),
]


@pytest.mark.parametrize("args, line", SWEEP_WITHOUT_M, ids=[" ".join(args) for args, _ in SWEEP_WITHOUT_M])
def test_a_comma_list_without_m_says_sweep_or_list(monkeypatch, capsys, tmp_path, args, line):
    check_one_line(*run_main(monkeypatch, capsys, *args, f"hydra.run.dir={tmp_path}", "dry_run=true"), line)


@pytest.mark.parametrize("mode", [[], ["-m"]], ids=["run", "multirun"])
@pytest.mark.parametrize("args, line", GRAMMAR, ids=[" ".join(args) for args, _ in GRAMMAR])
def test_a_grammar_mistake_is_one_line_that_says_what_to_type(monkeypatch, capsys, tmp_path, mode, args, line):
    where = [f"hydra.sweep.dir={tmp_path}"] if mode else [f"hydra.run.dir={tmp_path}"]
    check_one_line(*run_main(monkeypatch, capsys, *mode, *args, *where, "dry_run=true"), line)
    assert not any(tmp_path.iterdir())  # stopped while composing: nothing started, nothing written


def test_what_the_line_says_to_type_composes(monkeypatch, capsys, tmp_path):
    """The fix each line names, typed instead, gets past composing (a dry run)."""
    for args in (["+override=lr_cosine"], ["+override=[lr_cosine,lr_wsd]"], ["+override.lr=1e-3"],
                 ["+override=lr_wsd", "+override.lr.stable_steps=3"], ["+override=lr_cosine", "override.lr.min_ratio=0.2"],
                 ["+override=lr_cosine", "++override.lr.min_ratio=0.2"],
                 ["+override=lr_cosine", "override.lr.schedule=wsd", "+override.lr.decay_steps=3"]):  # fmt: skip
        run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
        monkeypatch.setattr(sys, "argv", ["tinker_exp", *args, f"hydra.run.dir={run_dir}", "dry_run=true"])
        main()
        assert (run_dir / "plan.json").is_file(), (args, capsys.readouterr().err)


@pytest.mark.parametrize(
    "arg, line",
    [
        ("+trainer.stpes=3", f"trainer.stpes: trainer has no key stpes; did you mean steps? (trainer's keys: {', '.join(f.name for f in fields(TrainerConfig))})"),
        ("++lora.rnk=8", f"lora.rnk: lora has no key rnk; did you mean rank? (lora's keys: {', '.join(f.name for f in fields(LoraConfig))})"),
        ("+foo=1", f"foo: the config has no key foo (the config's keys: {', '.join(f.name for f in fields(Config))})"),
    ],
)
def test_a_key_added_with_plus_where_the_schema_has_none_is_refused(monkeypatch, capsys, tmp_path, arg, line):
    """`+` composes it (open struct), and the typed config would drop it without a word."""
    check_one_line(*run_main(monkeypatch, capsys, arg, f"hydra.run.dir={tmp_path}", "dry_run=true"), line)
    assert not (tmp_path / "plan.json").exists()


def plugin_keys(target: str) -> str:
    """The keys a sweeper or launcher of ours takes, as the line lists them: its constructor's, or its config's."""
    import dataclasses
    import inspect

    from hydra.utils import get_class

    plugin = get_class(target)
    if getattr(plugin, "_CONF", None) is not None:  # our launchers take **params: their config dataclass says which
        return ", ".join(f.name for f in dataclasses.fields(plugin._CONF) if f.name != "_target_")
    return ", ".join(inspect.signature(plugin).parameters)


PLUGINS = "hydra_plugins.tinker_exp_plugins."
UNKNOWN_PLUGIN_KEYS = [
    (["hparams_search=lr_cosine", "+hydra.sweeper.kappa=2.0"],
     f"hydra.sweeper.kappa: hydra.sweeper has no key kappa (hydra.sweeper's keys: {plugin_keys(PLUGINS + 'optuna_sweeper.OptunaSweeper')})"),
    (["hparams_search=pbt_lr_cosine", "+hydra.sweeper.populaton=2"],
     "hydra.sweeper.populaton: hydra.sweeper has no key populaton; did you mean population? "
     f"(hydra.sweeper's keys: {plugin_keys(PLUGINS + 'pbt_sweeper.PBTSweeper')})"),
    (["optimizer.lr=1e-3,1e-4", "+hydra.sweeper.max_batch=2"],  # the grid (Hydra's basic sweeper's keys)
     "hydra.sweeper.max_batch: hydra.sweeper has no key max_batch; did you mean max_batch_size? (hydra.sweeper's keys: max_batch_size, params, share_prefixes)"),
    (["optimizer.lr=1e-3,1e-4", "+hydra.launcher.max_paralel=2"],  # was taken without a word, and ignored
     "hydra.launcher.max_paralel: hydra.launcher has no key max_paralel; did you mean max_parallel? "
     f"(hydra.launcher's keys: {plugin_keys(PLUGINS + 'launchers.LocalSweepLauncher')})"),
    (["hydra/launcher=slurm_local", "optimizer.lr=1e-3,1e-4", "+hydra.launcher.partion=debug"],
     "hydra.launcher.partion: hydra.launcher has no key partion; did you mean partition? "
     f"(hydra.launcher's keys: {plugin_keys(PLUGINS + 'launchers.SlurmSweepLauncher')})"),
]  # fmt: skip


@pytest.mark.parametrize("args, line", UNKNOWN_PLUGIN_KEYS, ids=["optuna", "pbt", "grid", "local-launcher", "slurm-launcher"])
def test_a_key_our_sweeper_or_launcher_does_not_take_is_one_line_naming_those_it_does(monkeypatch, capsys, tmp_path, args, line):
    """Added with +: Hydra's "Error in call to target ... unexpected keyword argument" over several lines (exit 1), or
    for a launcher nothing at all. Ours: the key, did-you-mean, the keys there are; exit 2, nothing written."""
    check_one_line(*run_main(monkeypatch, capsys, "-m", *args, f"hydra.sweep.dir={tmp_path / 'sweep'}"), line)
    assert not any(tmp_path.iterdir())


def test_a_data_path_that_is_a_directory_says_so(monkeypatch, capsys, tmp_path):
    line = f"data.path: '{tmp_path}' is a directory, not a JSONL or Parquet file"
    check_one_line(*run_main(monkeypatch, capsys, f"data.path={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}", "dry_run=true"), line)


def test_the_real_cli_prints_the_one_line_too(tmp_path):
    result = run_cli("override=lr_cosine", f"hydra.run.dir={tmp_path}")
    check_one_line(result.returncode, result.stdout, result.stderr, GRAMMAR[0][1])


def test_help_with_a_mistake_is_the_same_one_line(monkeypatch, capsys):
    check_one_line(*run_main(monkeypatch, capsys, "--help", "override=lr_cosine"), GRAMMAR[0][1])


def help_text(monkeypatch, capsys, flag: str = "--help") -> str:
    """What `python -m tinker_exp FLAG` prints (run once a process; the tests below read the same text)."""
    if flag not in _HELP:
        code, out, err = run_main(monkeypatch, capsys, flag)
        assert code == 0 and not err, err
        _HELP[flag] = out
    return _HELP[flag]


_HELP: dict[str, str] = {}


def test_help_lists_every_group_option_in_conf(monkeypatch, capsys):
    lines = help_text(monkeypatch, capsys).splitlines()
    groups = [path.relative_to(CONF_DIR).as_posix() for path in CONF_DIR.glob("**/") if any(path.glob("*.yaml"))]
    groups = [group for group in groups if group not in (".", "hydra/job_logging", "hydra/help")]  # not a user's pick
    assert "override" in groups and "hydra/launcher" in groups and "hydra/sweeper" in groups
    for group in groups:
        listed = [line for line in lines if line.startswith(f"{group}: ")]
        assert len(listed) == 1, group
        assert set(options(group)) <= set(listed[0].removeprefix(f"{group}: ").split(", ")), listed[0]


def test_help_lists_every_override_key_and_schedule_kind_with_its_parameters(monkeypatch, capsys):
    text = help_text(monkeypatch, capsys)
    assert f"Keys: {', '.join(OVERRIDE_KEYS)} (" in text
    assert all(spelling in text for spelling in ("learning_rate = lr", "beta1 = betas[0]", "beta2 = betas[1]"))
    section = text.split("Schedule kinds and their parameters")[1].split("== When is + needed ==")[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if line.startswith("   ") and rows:  # a long row wrapped: its parameters go on
            rows[last] += " " + line.strip()
        elif line.startswith("  "):
            last, _, shown = line.strip().partition(" ")
            rows[last] = shown.strip()
    assert set(PARAMS) <= set(rows)
    for kind, params in PARAMS.items():
        assert [name.split("=")[0].strip("[]") for name in rows[kind].split(", ")] == list(params), kind


def test_help_examples_run(monkeypatch, capsys, tmp_path):
    """The five example commands as a user types them (shell quoting included), as dry runs."""
    text = help_text(monkeypatch, capsys)
    examples = [line.strip() for line in text.split("== Examples ==")[1].splitlines() if line.strip().startswith("python -m tinker_exp")]
    assert len(examples) == 5
    for i, example in enumerate(examples):
        args = shlex.split(example)[3:]
        if "-m" in args:  # a sweep: composing its first job is enough here (test_sweeps runs sweeps)
            args = [arg.split(",")[0] if "=" in arg and "[" not in arg else arg for arg in args if arg != "-m"]
            args = [arg for arg in args if not arg.startswith("hydra/launcher=")]
        result = run_cli(*args, f"hydra.run.dir={tmp_path / str(i)}", "dry_run=true", timeout=120)
        assert result.returncode == 0, (example, result.stderr)
        assert (tmp_path / str(i) / "plan.json").is_file(), example


def test_hydra_help_stays_hydras(monkeypatch, capsys):
    text = help_text(monkeypatch, capsys, "--hydra-help")
    assert text.startswith("Hydra (") and "== Flags ==" in text and "hydra/launcher:" in text


def test_our_warnings_reach_the_terminal_as_one_line(tmp_path):
    """A leftover parameter of an earlier composed file is dropped with a warning: ours read as one line, as our
    errors do, not as Python's file:line and source echo."""
    result = subprocess.run(
        [sys.executable, "-m", "tinker_exp", "+override=[lr_cosine,lr_linear]", "dry_run=true", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "ignoring" in line]
    assert said == [
        "tinker_exp: warning: override.lr: ignoring min_ratio, num_cycles, not parameters of linear"
        " (left from an earlier override file?)"
    ], result.stderr


REFUSED_AS_TYPED = [
    (["+override.beta1=1.2"], "override.beta1: 1.2 is not in [0, 1)"),  # Tinker's spelling, not betas[0]
    (["+override.learning_rate=-1e-3"], "override.learning_rate: must be >= 0, got -0.001"),
    (["+override=lr_cosine", "override.lr.value=-1e-3"], "override.lr.value: must be >= 0, got -0.001"),  # not a step
    (["+override=adamw_one_cycle", "override.beta1.max_momentum=1.5"], "override.beta1.max_momentum: 1.5 is not in [0, 1)"),
    (["optimizer.clip_grad=-1"], "optimizer.clip_grad: must be >= 0, got -1.0"),
    (["backend.micro_batch_tokens=-1"], "backend.micro_batch_tokens: must be >= 0 (0: by sequences) or null (auto), got -1"),
    (["backend.micro_batch_tokens=64"], "backend.micro_batch_tokens=64: a micro batch must hold the longest sequence "
                                        "(data.max_length=128); set it >= 128, or 0 (by sequences)"),  # fmt: skip
    (["data.max_length=20000"], "backend.micro_batch_tokens=null: on cuda that is 16384 tokens a micro batch, less than "
                                "data.max_length=20000; set backend.micro_batch_tokens >= 20000, or 0 (by sequences)"),  # fmt: skip
    (["optimizer=rmsprop", "backend.optimizer_kernel=fused"],
     "backend.optimizer_kernel=fused: optimizer.name=RMSprop has no fused kernel in torch (fused: Adam, AdamW, SGD); "
     "use foreach, for_loop or auto"),  # fmt: skip
    (["optimizer=muon", "backend.optimizer_kernel=foreach"],
     "backend.optimizer_kernel=foreach: optimizer.name=Muon has no such choice; use auto"),
    (["backend=cpu", "backend.attention=flash_attention_2"],  # a dry run too: no torch needed to know a CPU run's
     "backend.attention=flash_attention_2: it runs only for bf16 on a GPU with bf16 (this run: cpu, fp32); use auto or sdpa"),
]


@pytest.mark.parametrize("args, line", REFUSED_AS_TYPED, ids=[" ".join(args) for args, _ in REFUSED_AS_TYPED])
def test_a_refused_value_is_named_as_typed_in_one_line(monkeypatch, capsys, tmp_path, args, line):
    check_one_line(*run_main(monkeypatch, capsys, *args, f"hydra.run.dir={tmp_path}", "dry_run=true"), line)


def test_hparams_search_without_m_runs_the_study(tmp_path):
    """`hparams_search=NAME` is a study with or without -m (the preset sets hydra.mode): its trial's dir and the
    study's summary, not one ordinary run."""
    result = run_cli("hparams_search=lr_cosine", "dry_run=true", "hydra.sweeper.n_trials=1", "hydra.sweeper.n_jobs=1",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dry run: 1 trials planned" in result.stdout + result.stderr
    assert (tmp_path / "sweep" / "0" / "plan.json").is_file() and not (tmp_path / "run").exists()


def test_m_without_a_launcher_runs_on_the_local_launcher_with_its_summary(tmp_path):
    """`-m` alone: the local launcher (hydra/launcher=basic is ours), so the sweep ends with its summary and
    summary files, as with hydra/launcher=local; not Hydra's basic launcher (jobs in this process, no summary)."""
    result = run_cli("-m", "optimizer.lr=1e-3,3e-4", "dry_run=true", f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "sweep summary" in result.stdout + result.stderr
    assert [json.loads(line)["status"] for line in (tmp_path / "summary.jsonl").read_text().splitlines()] == ["COMPLETED"] * 2


@pytest.mark.parametrize("argv, shown", [(["--help"], True), (["-h", "trainer.steps=3"], True), (["--hel"], True),
                                         (["trainer.steps=3"], False), (["--hydra-help"], False), (["--cfg", "nope"], False)])  # fmt: skip
def test_the_help_sections_are_built_only_when_the_help_is_printed(argv, shown):
    """Hydra resolves the help template at every compose: a command that prints no help gets empty sections (they
    scan Hydra's search path), one that does gets them, as Hydra's own parser reads --help (abbreviated too)."""
    from tinker_exp.config import cli_help

    try:
        cli_help.show_if_asked(argv)
        assert cli_help.SHOWN is shown
        assert (cli_help.help_section("overrides") != "") is shown
    finally:
        cli_help.SHOWN = False


def refused_on_the_run_path(given: Path) -> dict[str, tuple[list[str], str]]:
    """A command refused at each stage of a run's path, with the start of its one line: composing, the config's
    checks, the data, the start point, the pool, the device, the model's LoRA targets, tokenizing, the run dir."""
    bad_rows = given / "bad.jsonl"
    bad_rows.write_text('{"prompt": "a", "response": "b"}\n{"prompt": 1}\n')
    a_file = given / "a_file"
    private = given / "pools"  # a pool's folder must be private to the user (docs/pool.md)
    private.mkdir(mode=0o700, exist_ok=True)
    a_file.write_text("")
    return {
        "a misspelled key": (["trainer.stpes=3"], "config error: trainer.stpes: trainer has no key stpes"),
        "a bad value": (["optimizer.lr=-1"], "config error: optimizer.lr: must be >= 0"),
        "a bad value, run in its run dir": (["hydra.job.chdir=true", "optimizer.lr=-1"], "config error: optimizer.lr: must be >= 0"),
        "a bad row": ([f"data.path={bad_rows}"], f"config error: data.path: {bad_rows}:2: "),
        "no checkpoint": (["resume=must"], "config error: resume=must, but there is no checkpoint in "),
        "no pool there": ([f"backend.pool={private / 'no.sock'}"], f"config error: backend.pool={private / 'no.sock'}: no pool answers there"),
        "a GPU-only setting on cpu": (["backend.attention=flash_attention_2", "backend.device=cpu"],
                                      "config error: backend.attention=flash_attention_2: it runs only for bf16 on a GPU"),  # fmt: skip
        "a LoRA target the model lacks": (["lora=r8", "lora.target_modules=[nope]"], "config error: lora.target_modules: 'nope' matches no module"),
        "a row too long": (["data.truncation=error", "data.max_length=8"], "config error: data.path: "),
        "a model cache that is a file": ([f"model.cache_dir={a_file}"], f"config error: model.cache_dir={a_file}: {a_file} is a file, not a folder"),
        "a run dir below a file": ([f"hydra.run.dir={a_file}/run"], f"config error: hydra.run.dir={a_file}/run: {a_file} is a file, not a folder"),
    }


def test_a_refused_command_writes_nothing_anywhere(tmp_path):
    """Each command, typed in an empty folder with Hydra's default run dir (outputs/runs/DATE/TIME) and W&B on: exit
    2, one line, no traceback, and not a file or folder made below that folder (no outputs/, no W&B dir, no log)."""
    given, cwd = tmp_path / "given", tmp_path / "cwd"
    given.mkdir()
    cwd.mkdir()
    for what, (args, line) in refused_on_the_run_path(given).items():
        result = run_cli(*args, "logger=wandb", cwd=cwd)
        assert result.returncode == 2, (what, result.stderr[-3000:])
        (said,) = result.stderr.splitlines()
        assert said.startswith(f"tinker_exp: {line}"), (what, said)
        assert "Traceback" not in result.stdout + result.stderr, what
        assert sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*")) == [], what


def test_a_config_dir_that_is_no_folder_is_one_line(monkeypatch, capsys, tmp_path):
    """Hydra's "Additional config directory ... not found" (exit 1, with its HYDRA_FULL_ERROR line) as ours."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for args, line in ((["--config-dir", str(tmp_path / "nope")], f"--config-dir {tmp_path / 'nope'}: no such folder"),
                       ([f"--config-dir={a_file}"], f"--config-dir {a_file}: {a_file} is a file, not a folder")):  # fmt: skip
        check_one_line(*run_main(monkeypatch, capsys, *args, "+override=lr_cosine", f"hydra.run.dir={tmp_path / 'run'}", "dry_run=true"), line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


FIRST_CONTACT = [
    (["--dry-run"], "--dry-run: not a flag: a key is set as KEY=VALUE, as in dry_run=true"),
    (["--steps", "10"], "--steps: not a flag: a key is set as KEY=VALUE, as in trainer.steps=VALUE"),
    (["--trainer.steps=3"], "--trainer.steps=3: not a flag: a key is set as KEY=VALUE, as in trainer.steps=3"),
    (["--cgf", "job"], "--cgf: not a flag; did you mean --cfg? (flags: --help, --hydra-help, --version, --cfg, --resolve, --package, "
                       "--run, --multirun, --shell-completion, --config-path, --config-name, --config-dir, --experimental-rerun, --info); "
                       "keys are set as KEY=VALUE"),  # fmt: skip
    (["steps=10"], "steps: the config has no key steps; did you mean trainer.steps?"),  # not plan_steps, the closest top-level name
    (["lr=1e-3"], "lr: the config has no key lr; did you mean optimizer.lr?"),  # not lora
]


@pytest.mark.parametrize("args, line", FIRST_CONTACT, ids=[" ".join(args) for args, _ in FIRST_CONTACT])
def test_a_flag_or_a_bare_key_a_new_user_types_gets_the_key_to_type(monkeypatch, capsys, tmp_path, args, line):
    """Hydra's parser prints its usage and "__main__.py: error: unrecognized arguments" for an unknown flag; a bare
    key named as in a group pointed at the closest top-level name. Nothing written."""
    check_one_line(*run_main(monkeypatch, capsys, *args, f"hydra.run.dir={tmp_path / 'run'}"), line)
    assert not any(tmp_path.iterdir())
