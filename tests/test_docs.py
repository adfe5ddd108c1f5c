"""The docs hold: every relative link of README.md and docs/*.md resolves (file and anchor), and the documented
examples that a newcomer copies run as written (as dry runs: no torch, no workers)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, environment, run_module

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")


def prose_lines(path: Path) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed (neither holds links)."""
    lines, in_code = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (inline code's backticks too), spaces to
    hyphens; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        heading = None if in_code else HEADING.match(line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading["title"].lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(path: Path) -> list[tuple[str, str]]:
    return [
        (match["text"], match["target"])
        for line in prose_lines(path)
        for match in LINK.finditer(line)
        if not re.match(r"[a-z][a-z+.-]*:", match["target"])  # http:, https:, mailto:
    ]


def test_the_link_check_sees_links_and_anchors():
    readme = relative_links(REPO / "README.md")
    assert ("Schedules", "docs/schedules.md") in readme
    assert "when-is--needed" in anchors(REPO / "README.md")  # `+` and its backticks dropped
    assert "plan-files-planjson-and-planpng" in anchors(REPO / "docs" / "schedules.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for text, target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"[{text}]({target}): no file {linked}")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"[{text}]({target}): no heading with anchor #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target.partition("#")[0] for _, target in relative_links(REPO / "README.md")}
    assert {f"docs/{page.name}" for page in PAGES[1:]} <= linked


def code_block(path: Path, containing: str) -> list[str]:
    """The lines of the one fenced block of `path` that contains `containing`."""
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    found = [block for block in blocks if any(containing in line for line in block)]
    assert len(found) == 1, f"{len(found)} blocks of {path.name} contain {containing!r}"
    return found[0]


def run_shell(lines: list[str], home: Path, extra: str = "") -> subprocess.CompletedProcess:
    """Run documented shell lines as a user would, in a fresh HOME (also the working dir, so outputs/ lands
    there): `python` is this interpreter, `tinker_exp` this checkout (its editable install). Lines that are all
    `python -m MODULE ARGS` with nothing for the shell to do but split words and expand $HOME run one after another
    through helpers.run_module (the CLI zygote: the same process as a fresh `python`, without its start-up), as
    `set -e` would: up to the first that fails, their output joined; anything else runs in bash."""
    env = {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "WANDB_MODE": "offline"}
    commands = [re.sub(r"\s+#\s.*$", "", line) + extra if line.startswith("python ") else line for line in lines]
    words = [python_words(command, home) for command in commands]
    if all(words):
        done = []
        for w in words:
            done.append(run_module(w[2], *w[3:], env=env, cwd=home))
            if done[-1].returncode:
                break
        return subprocess.CompletedProcess(commands, done[-1].returncode, "".join(d.stdout for d in done), "".join(d.stderr for d in done))
    script = "set -euo pipefail\n" + "\n".join(commands)
    return subprocess.run(["bash", "-c", script], cwd=home, env=environment(env), capture_output=True, text=True, timeout=300)


def python_words(command: str, home: Path) -> list[str] | None:
    """The words bash would run for `python -m MODULE ARGS` (its $HOME, ${HOME} and leading ~/ expanded, not in
    single quotes), or None where the shell has more to do or the command is another."""
    expanded = re.sub(r"'[^']*'|\$HOME\b|\$\{HOME\}|(?<!\S)~(?=/)", lambda m: m[0] if m[0][0] == "'" else str(home), command)
    if SHELL_WORK.search(re.sub(r"'[^']*'", "", expanded)):
        return None
    words = shlex.split(expanded)
    return words if words[:2] == ["python", "-m"] and len(words) > 2 else None


SHELL_WORK = re.compile(r"[$~`|&;<>(){}*?!\\]")
"""What in a line the shell would expand, redirect or run on its own (split words and quotes are all run_module's)."""


def run_dirs(home: Path) -> list[Path]:
    return sorted((home / "outputs" / "runs").glob("*/*"))


def test_an_own_override_file_through_config_dir(tmp_path: Path):
    """docs/schedules.md: ~/my_conf/override/my_sched.yaml, selected with --config-dir and +override=my_sched."""
    block = code_block(REPO / "docs" / "schedules.md", "--config-dir ~/my_conf")
    end_of_file = block.index("YAML")  # the heredoc's last line
    dry_runs = [line for line in block if "dry_run=true" in line]
    assert dry_runs and all("--config-dir ~/my_conf +override=my_sched" in line for line in dry_runs)
    done = run_shell(block[: end_of_file + 1] + dry_runs, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "my_conf" / "override" / "my_sched.yaml").exists()
    (run_dir,) = run_dirs(tmp_path)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["override"]["lr"]["schedule"] == "cosine" and plan["override"]["lr"]["value"] == 3.0e-4
    assert (run_dir / "plan.png").exists()  # a value is sent, so the plan is drawn


def readme_chat_example(home: Path) -> list[str]:
    """The README's chat rows written to ~/chat.jsonl; the commands of that section."""
    rows = code_block(REPO / "README.md", '{"messages": [{"role": "user"')
    (home / "chat.jsonl").write_text("\n".join(rows) + "\n")
    return code_block(REPO / "README.md", "python -m tinker_exp data.path=$HOME/chat.jsonl dry_run=true")


def test_the_readme_chat_rows_and_their_dry_run(tmp_path: Path):
    """The README says its two rows alone leave no validation row (an error naming data.val_fraction), and
    that data.val_fraction=null runs them."""
    commands = readme_chat_example(tmp_path)
    dry_run = [line for line in commands if "dry_run=true" in line]
    too_small = run_shell(dry_run, tmp_path)
    assert too_small.returncode == 2 and "data.val_fraction" in too_small.stderr, too_small.stderr
    assert "Traceback" not in too_small.stderr
    done = run_shell(dry_run, tmp_path, extra=" data.val_fraction=null")
    assert done.returncode == 0, done.stderr
    assert not (run_dirs(tmp_path)[-1] / "plan.png").exists()  # no override: nothing sent, no plot


def test_the_readme_two_point_sweep_as_a_dry_run(tmp_path: Path):
    """The README's sweep over the user's data, as local processes: two points, both complete, one summary."""
    (sweep,) = [line for line in readme_chat_example(tmp_path) if " -m hydra/launcher=local" in line]
    done = run_shell([sweep], tmp_path, extra=" data.val_fraction=null dry_run=true")
    assert done.returncode == 0, done.stderr
    (sweep_dir,) = (tmp_path / "outputs" / "sweeps").glob("*/*")
    jobs = [json.loads(line) for line in (sweep_dir / "summary.jsonl").read_text().splitlines()]
    assert len(jobs) == 2 and {job["status"] for job in jobs} == {"COMPLETED"}


def section(path: Path, heading: str) -> list[str]:
    """The lines under `heading` up to the next heading of any level."""
    lines = path.read_text().splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if HEADING.match(lines[i])), len(lines))
    return lines[start:end]


def test_the_readme_single_runs_compose_and_plan(tmp_path: Path):
    """Every single-run line of the README's command list (not the sweeps, not the user's data file) composes
    and plans as a dry run."""
    block = code_block(REPO / "README.md", "python -m tinker_exp +override=lr_cosine ")
    commands = [line.removeprefix("python -m tinker_exp") for line in block if line.startswith("python -m tinker_exp")]
    runs = [f"python -m tinker_exp{args}" for args in commands if " -m " not in args and "$HOME" not in args
            and not args.startswith(".")]  # not the pool's own commands (tests/test_pool.py runs them)  # fmt: skip
    assert len(runs) >= 6
    for line in runs:
        done = run_shell([line], tmp_path, extra=" dry_run=true")
        assert done.returncode == 0, f"{line}\n{done.stderr}"


def test_the_rl_docs_own_reward_is_accepted_as_written(tmp_path: Path):
    """docs/rl.md: its rows and reward module written as shown, then its command as a dry run from that directory
    (the rows read, the reward imported and tried on each); the same reward returning a list is refused."""
    rl_doc = REPO / "docs" / "rl.md"
    (tmp_path / "rows.jsonl").write_text("\n".join(code_block(rl_doc, '"Name a prime number below 20."')) + "\n")
    (tmp_path / "my_rewards.py").write_text("\n".join(code_block(rl_doc, "def named_a_prime(")) + "\n")
    command = code_block(rl_doc, "python -m tinker_exp env.prompts=rows.jsonl env.reward=my_rewards:named_a_prime")
    done = run_shell(command, tmp_path, extra=" dry_run=true")
    assert done.returncode == 0, done.stderr
    [run_dir] = run_dirs(tmp_path)
    assert (run_dir / "plan.json").exists() and not (run_dir / "metrics.jsonl").exists()  # a dry run starts nothing
    (tmp_path / "my_rewards.py").write_text("def named_a_prime(row, response):\n    return row['primes']\n")
    refused = run_shell(command, tmp_path, extra=" dry_run=true")
    assert refused.returncode == 2 and "(list), not a number, on env.prompts: rows.jsonl:1" in refused.stderr, refused.stderr


def test_when_plus_is_needed_as_the_readme_says(tmp_path: Path):
    """Each `write` cell of the README's table composes and plans; each error it quotes is what the CLI says."""
    lines = section(REPO / "README.md", "### When is `+` needed")
    table = [line for line in lines if line.startswith("| ") and "`" in line.split("|")[2]]
    writes = [re.search(r"`([^`]+)`", line.split("|")[2])[1] for line in table]
    assert len(writes) == 5 and any(write.startswith("+override=[") for write in writes)
    for write in writes:
        done = run_shell([f"python -m tinker_exp {write}"], tmp_path, extra=" dry_run=true")
        assert done.returncode == 0, f"{write}\n{done.stderr}"
    text = " ".join(lines)
    for args, message in [
        ("override=lr_cosine", "override=lr_cosine: type +override=lr_cosine (the + adds the group, which is not in the defaults list"),
        ("override.lr=5e-4", "override.lr=5e-4: no override is selected, so override.lr is new: type +override.lr=5e-4"),
        ("+override=lr_wsd override.lr.warmup_shape=cosine", "does not set warmup_shape: type +override.lr.warmup_shape=cosine"),
        ("+override=constant +override.lr=5e-4", "+override.lr=5e-4: override.lr is set already: type override.lr=5e-4"),
        ("+override=lr_wsd +override=beta2_warmup", "one +override flag only; compose presets in it: +override=[lr_wsd,beta2_warmup]"),
    ]:
        assert message in text
        done = run_shell([f"python -m tinker_exp {args}"], tmp_path, extra=" dry_run=true")
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, f"{args}\n{done.stderr}"
    done = run_shell(["python -m tinker_exp +override=constant ++override.lr=5e-4"], tmp_path, extra=" dry_run=true")
    assert done.returncode == 0, done.stderr


def transcripts(path: Path) -> list[tuple[str, list[str]]]:
    """Each `$ python -m tinker_exp ...` line of `path`'s fenced blocks and the output lines quoted under it (up to
    the next `$` line or the block's end; a `...` line stands for lines left out)."""
    found, in_code, quoted = [], False, None
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            in_code, quoted = not in_code, None
        elif in_code and line.startswith("$ python -m tinker_exp"):
            quoted = []
            found.append((line.removeprefix("$ "), quoted))
        elif quoted is not None and line.strip() not in ("", "..."):
            quoted.append(line)
    return found


@pytest.mark.parametrize(
    "page", [REPO / "README.md", *(REPO / "docs" / name for name in ("schedules.md", "optimizers.md", "branching.md", "population.md"))], ids=lambda p: p.name
)
def test_quoted_outputs_are_what_the_cli_prints(page: Path, tmp_path: Path):
    """Every `$ python -m tinker_exp ...` transcript on the page, run (as a dry run): each quoted line is in its
    output; a quoted config error comes with exit status 2 and no traceback."""
    quoted = [(command, lines) for command, lines in transcripts(page) if lines]
    assert len(quoted) >= {"schedules.md": 4, "optimizers.md": 7, "branching.md": 4}.get(page.name, 1)
    for command, lines in quoted:
        done = run_shell([command], tmp_path, extra="" if "dry_run=true" in command else " dry_run=true")
        output = done.stdout + done.stderr
        error = any(line.startswith("tinker_exp: config error") for line in lines)
        assert done.returncode == (2 if error else 0) and "Traceback" not in output, f"{command}\n{output}"
        for line in lines:
            assert line in output.splitlines(), f"{command}: {line!r} not in\n{output}"


def test_the_schedules_examples_compose_and_plan(tmp_path: Path):
    """The schedules section's example lines (all but the preview of a run dir's plan.json) and the after-the-end
    one dry-run as written,
    and what its comments say of the peak, the fractions and the end holds in their plan.json."""
    page = REPO / "docs" / "schedules.md"
    block = code_block(page, "+override=lr_cosine override.lr.value=3e-4") + code_block(page, "+override.lr.total_steps=10")
    runs = [line for line in block if line.startswith("python -m tinker_exp ")]
    assert len(runs) >= 8
    plans = {}
    for line in runs:
        done = run_shell([line], tmp_path, extra="" if "dry_run=true" in line else " dry_run=true")
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        plans[re.sub(r"\s+#\s.*$", "", line)] = json.loads((run_dirs(tmp_path)[-1] / "plan.json").read_text())
    lr = {command: plan["override"].get("lr") for command, plan in plans.items()}
    assert lr["python -m tinker_exp optimizer.lr=1e-2 +override=lr_cosine"]["value"] == 1e-2
    assert lr["python -m tinker_exp +override=lr_cosine override.lr.value=3e-4"]["value"] == 3e-4
    assert lr["python -m tinker_exp +override=lr_cosine override.lr.warmup_steps=0.25"]["warmup_steps"] == 5  # of 20
    wsd = lr["python -m tinker_exp +override=lr_wsd trainer.steps=1000000 dry_run=true"]
    assert (wsd["warmup_steps"], wsd["decay_steps"]) == (50_000, 200_000)
    assert wsd["fractions"] == {"warmup_steps": 0.05, "decay_steps": 0.2}
    (short,) = [plan for command, plan in plans.items() if "lr_cosine +override.lr.total_steps=10" in command]
    past_the_end = [row["lr"] for row in short["rows"] if row["step"] >= 10]
    assert past_the_end and past_the_end == pytest.approx([1e-3 * 0.1] * len(past_the_end))  # lr * min_ratio, held
    (cycle,) = [plan for command, plan in plans.items() if "adamw_one_cycle +override.lr.total_steps=10" in command]
    floor = [row["lr"] for row in cycle["rows"] if row["step"] >= 9]
    assert floor and floor == pytest.approx([1e-3 / 25 / 1e4] * len(floor))  # one_cycle's floor, held past its end
    one_cycle = plans["python -m tinker_exp +override=adamw_one_cycle"]["rows"]
    peak = next(row for row in one_cycle if row["step"] == 5)
    assert (one_cycle[0]["lr"], peak["lr"], one_cycle[0]["beta1"], peak["beta1"]) == pytest.approx((4e-5, 1e-3, 0.9, 0.85))


def test_a_data_path_that_is_a_directory_as_the_data_page_quotes(tmp_path: Path):
    """docs/data-and-models.md's `data.path=data/` transcript, run beside a folder `data/`: its one line, exit 2."""
    (quoted,) = [(command, lines) for command, lines in transcripts(REPO / "docs" / "data-and-models.md") if "data/" in command]
    command, lines = quoted
    (tmp_path / "data").mkdir()
    done = run_shell([command], tmp_path, extra=" dry_run=true")
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output
    assert lines and all(line in output.splitlines() for line in lines), output


def test_the_report_command_says_what_the_logging_page_quotes(tmp_path: Path):
    """docs/logging.md's `python -m tinker_exp.report` transcripts, run in order: a folder that is no run dir is
    one line and exit 2; a dry run's dir (no step logged) draws nothing, one line and exit 1; nothing is drawn."""
    quoted = transcripts(REPO / "docs" / "logging.md")
    assert [command.split()[2] for command, _ in quoted] == ["tinker_exp.report", "tinker_exp", "tinker_exp.report"]
    (tmp_path / "outputs" / "my_notes").mkdir(parents=True)
    exit_codes = []
    for command, lines in quoted:
        done = run_shell([command], tmp_path)
        output = done.stdout + done.stderr
        assert "Traceback" not in output and all(line in output.splitlines() for line in lines), f"{command}\n{output}"
        exit_codes.append(done.returncode)
    assert exit_codes == [2, 0, 1]
    assert not list(tmp_path.rglob("*.png"))  # a dry run without an override draws no plan, the report nothing


def test_the_optimizers_examples_plan_what_their_comments_say(tmp_path: Path):
    """docs/optimizers.md's example lines dry-run as written; the optimizer each builds and the values it sends are
    what the page says (SGD's one cycle, Muon's peak at its own lr, a beta alone keeping the other, learning_rate)."""
    page = REPO / "docs" / "optimizers.md"
    runs = [line for line in code_block(page, "optimizer.nesterov=true") + code_block(page, "+override.beta1=0.8")
            if line.startswith("python -m tinker_exp ")]
    assert len(runs) == 6 and all("dry_run=true" in line for line in runs)
    plans = {}
    for line in runs:
        done = run_shell([line], tmp_path)
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        plans[re.sub(r"\s+#\s.*$", "", line).split(" dry_run")[0].removeprefix("python -m tinker_exp ")] = json.loads(
            (run_dirs(tmp_path)[-1] / "plan.json").read_text()
        )
    sgd = plans["optimizer=sgd +override=sgd_one_cycle"]
    assert sgd["optimizer"]["lr"] == 0.05 and sgd["optimizer"]["momentum"] == 0.9
    assert set(sgd["override"]) == {"lr", "momentum"}
    assert sgd["override"]["lr"]["value"] == 0.05 and sgd["override"]["momentum"]["max_momentum"] == 0.9  # the peaks
    muon = plans["optimizer=muon +override=lr_cosine"]
    assert muon["optimizer"]["lr"] == 2e-3 and muon["override"]["lr"]["value"] == 2e-3
    assert plans["optimizer=sgd optimizer.nesterov=true"]["optimizer"]["nesterov"] is True
    assert all(row["lr"] == 1e-4 for row in plans["+override.learning_rate=1e-4"]["rows"])
    assert all((row["beta1"], row["beta2"]) == (0.8, 0.999) for row in plans["+override.beta1=0.8"]["rows"])


def test_the_sweeps_pages_refused_points_are_what_the_cli_prints(tmp_path: Path):
    """docs/sweeps-and-slurm.md's quoted sweeps refused before launch (a bad point, an override one of the swept
    optimizers cannot take): each quoted line is printed, exit 2, no traceback, and no sweep dir is written."""
    quoted = [(command, lines) for command, lines in transcripts(REPO / "docs" / "sweeps-and-slurm.md")
              if lines and "no job was started" in lines[0]]
    assert any("optimizer=adamw,sgd" in command for command, _ in quoted)
    for command, lines in quoted:
        done = run_shell([command], tmp_path)
        output = done.stdout + done.stderr
        assert done.returncode == 2 and "Traceback" not in output, f"{command}\n{output}"
        assert all(line in output.splitlines() for line in lines), f"{command}\n{output}"
    assert not (tmp_path / "outputs").exists()


def test_the_logging_page_names_the_file_a_study_keeps():
    """A study keeps Optuna's journal (an earlier version's optuna.db is still read): what report.py looks for."""
    from tinker_exp.sweep.study import JOURNAL_FILE, SQLITE_FILE

    text = " ".join((REPO / "docs" / "logging.md").read_text().split())
    assert f"A study (a sweep dir with `{JOURNAL_FILE}`, or an earlier version's `{SQLITE_FILE}`)" in text


def test_the_forecast_pages_rank_example_ranks_plans_on_the_data_the_law_was_fitted_on():
    """docs/forecast.md's `rank` line, $DATA as its DATA= line sets it: each quoted PLAN composes (as a run would)
    with the corpus that its fit's runs trained on, so rank has no other data set to warn of."""
    from tinker_exp.forecast.plans import plan_lr

    lines = (REPO / "docs" / "forecast.md").read_text().splitlines()
    data = next(line for line in lines if line.startswith('DATA="') and "# the fitted runs' data" in line)
    data = shlex.split(data.split("#")[0])[0].removeprefix("DATA=")
    rank = next(line for line in lines if line.startswith("python -m tinker_exp.forecast rank "))
    plans = [arg for arg in shlex.split(rank.replace("$DATA", data))[4:] if "=" in arg]
    assert len(plans) == 2
    fitted = dict(arg.split("=", 1) for arg in data.split())
    for plan in plans:
        settings = plan_lr(plan).settings
        assert {key: settings[key] for key in fitted} == fitted, plan


def test_the_readmes_command_list_has_as_many_commands_as_its_heading_says():
    lines = (REPO / "README.md").read_text().splitlines()
    heading = next(line for line in lines if re.match(r"## \w+ commands$", line))
    words = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen".split()
    block = code_block(REPO / "README.md", "python -m tinker_exp +override=lr_cosine ")
    assert len([line for line in block if line.startswith("python -m ")]) == words.index(heading.split()[1].lower()) + 1


def test_make_install_says_each_step_as_the_readme_quotes_and_hides_only_pips_location_flood(tmp_path: Path):
    """`make -n install` (nothing run) runs scripts/install.sh into the venv asked for; the README's quoted step line
    is what the script echoes; its filter of pip's and uv's output, run on pip-shaped output, drops the per-package
    "Location ... is ignored" warnings, keeps every other line and the installer's exit status (bash pipefail)."""
    venv = tmp_path / "venv"
    planned = subprocess.run(["make", "-n", "--no-print-directory", "install", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert f"bash scripts/install.sh python3 {venv}" in planned
    script = (REPO / "scripts" / "install.sh").read_text()
    quoted = re.search(r"`(installing torch [^`]+)`", (REPO / "README.md").read_text())[1]
    assert f'echo "{quoted.replace(".venv", "$venv")}"' in script
    assert [line.strip() for line in script.splitlines() if line.strip().startswith("echo")][-1].startswith('echo "installed into')
    (quiet,) = [line for line in script.splitlines() if line.startswith("quiet()")]
    pip = "printf \"WARNING: Location 'file:///x/simple/six/' is ignored: it is neither a file nor a directory.\\nERROR: no six\\n\"; exit 3"
    shown = subprocess.run(["bash", "-c", f"set -o pipefail; {quiet}\nquiet bash -c {shlex.quote(pip)}"], capture_output=True, text=True)
    assert (shown.returncode, shown.stdout) == (3, "ERROR: no six\n")
