"""The layers hold: the pure packages import no torch, verl, ray or transformers; only the runtime imports them."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "tinker_exp"
HEAVY = ("torch", "verl", "ray", "transformers", "tokenizers", "peft")
PURE = ["tinker_exp.config", "tinker_exp.optim", "tinker_exp.train", "tinker_exp.sweep", "tinker_exp.errors", "tinker_exp.memory",
        "tinker_exp.formats", "tinker_exp.threads", "tinker_exp.rl", "tinker_exp.main", "tinker_exp.run", "tinker_exp.place", "tinker_exp.forecast", "tinker_exp.pool", "hydra_plugins.tinker_exp_plugins"]  # fmt: skip


def modules(package: str) -> list[str]:
    folder = REPO / package.replace(".", "/")
    if folder.is_dir():
        return sorted(
            ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in folder.rglob("*.py")
        )
    return [package]


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_import_nothing_heavy(package):
    """Imported in a fresh interpreter (every module of the package): none of the heavy packages is loaded."""
    names = modules(package)
    code = "import sys\n" + "".join(f"import {name}\n" for name in names)
    code += f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{package} imports {out.stdout.strip()}"


def imported_roots(path: Path) -> set[str]:
    """Top-level packages a module imports anywhere in it (function-level imports too)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_only_the_runtime_imports_verl_ray_or_torch():
    """Even lazily: a function-level `import ray` outside tinker_exp/runtime/ is a layer leak."""
    runtime = PACKAGE / "runtime"
    sources = [*PACKAGE.rglob("*.py"), *(REPO / "hydra_plugins").rglob("*.py")]
    leaks = {
        str(path.relative_to(REPO)): sorted(imported_roots(path) & set(HEAVY))
        for path in sources
        if runtime not in path.parents
    }
    assert {path: found for path, found in leaks.items() if found} == {}
    assert imported_roots(runtime / "workers.py") >= {"ray", "verl", "torch"}  # the check looks where it should


# Each module's layer; a module may import its own layer and those below it, never one above, and no set of
# modules may import each other in a circle (lazy, function-level imports count: they run too).
LAYERS = [
    ("tinker_exp", "tinker_exp.errors", "tinker_exp.formats", "tinker_exp.memory", "tinker_exp.threads"),  # plain helpers every layer uses
    ("tinker_exp.optim",),  # the per-step plan: schedules, converter, checks, preview (numpy)
    ("tinker_exp.config",),  # schema, validation, compose errors, --help (shows the plan's keys and kinds)
    ("tinker_exp.train", "tinker_exp.rl"),  # the loop and its protocols, sinks, checkpoints, data, start point; RL envs
    ("tinker_exp.runtime", "tinker_exp.sweep", "tinker_exp.forecast"),  # verl/Ray wiring; sweeps' member and trial sides, reports
    ("tinker_exp.assemble", "tinker_exp.place"),
    # what a run is put together from; where it trains (the seam: its places, a pool's lease, the wire, pool processes)
    ("tinker_exp.run",),  # the run's steps: validate, check its inputs, hold its place, record, train, its objective
    ("tinker_exp.report", "tinker_exp.serve", "tinker_exp.pool"),
    # entry points: reports, the Tinker API server, the pool's process
    ("tinker_exp.main", "tinker_exp.__main__", "tinker_exp.multinode"),  # the CLI: Hydra's entry, its errors and run dirs
    ("hydra_plugins",),  # Hydra's launchers and sweepers, around the entry point
]
ENTRY_POINTS = {
    "the CLI": ("tinker_exp.main", "tinker_exp.__main__", "tinker_exp.multinode"),
    "the pool's process": ("tinker_exp.pool.host", "tinker_exp.pool.__main__"),
    "the server": ("tinker_exp.serve",),
    "the sweeps": ("hydra_plugins",),
}
"""Each asks the run module (and the place seam) and none imports another: a run's side of a pool is the seam's
(tinker_exp/place/ chooses the pool; the sweeps start theirs with place/pools.py), not the CLI's."""


def layer_of(module: str) -> int:
    ranks = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
             if module == prefix or module.startswith(prefix + ".") and prefix != "tinker_exp"]  # fmt: skip
    assert ranks, f"{module}: in no layer of LAYERS (add it where it belongs)"
    return max(ranks)[1]


def import_graph() -> dict[str, set[str]]:
    """Every module of tinker_exp/ and hydra_plugins/ -> the modules of ours it imports (anywhere in it)."""
    paths = {name: REPO / (name.replace(".", "/") + ".py") for name in modules("tinker_exp") + modules("hydra_plugins.tinker_exp_plugins")}
    paths = {name: path if path.exists() else path.with_suffix("") / "__init__.py" for name, path in paths.items()}

    def ours(name: str) -> str | None:  # the module a dotted name lands in (a package's __init__ for a package)
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {ours(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(ours(node.module))
                found |= {ours(f"{node.module}.{alias.name}") for alias in node.names if f"{node.module}.{alias.name}" in paths}
        graph[name] = found - {None, name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_and_no_upward_imports():
    graph = import_graph()
    assert len(graph) > 50 and graph["tinker_exp.run"] >= {"tinker_exp.train.loop", "tinker_exp.config"}  # it looks
    assert circles(graph) == []
    upward = sorted(f"{name} -> {other}" for name, found in graph.items() for other in found if layer_of(other) > layer_of(name))
    assert upward == []


def entry_point_of(module: str) -> str | None:
    return next((name for name, prefixes in ENTRY_POINTS.items() for prefix in prefixes
                 if module == prefix or module.startswith(prefix + ".")), None)  # fmt: skip


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one entry point into another, and imports of a pool's wire or processes from outside the seam and
    the pool's process but for SWEEP_POOLS."""
    found = [f"{name} -> {other}" for name, imports in graph.items() for other in imports
             if entry_point_of(name) and entry_point_of(other) and entry_point_of(name) != entry_point_of(other)]  # fmt: skip
    found += [f"{name} -> {other}" for name, imports in graph.items() for other in imports
              if other in POOL_SIDE and not name.startswith(("tinker_exp.place", "tinker_exp.pool"))
              and (name, other) not in SWEEP_POOLS]  # fmt: skip
    return sorted(found)


POOL_SIDE = ("tinker_exp.place.wire", "tinker_exp.place.pools")
"""How a pool is spoken to and started: the seam's own business (`choose` finds the pool, `Lease` holds it)."""
SWEEP_POOLS = {("hydra_plugins.tinker_exp_plugins.launchers", "tinker_exp.place.pools"),
               ("hydra_plugins.tinker_exp_plugins.optuna_sweeper", "tinker_exp.place.pools")}  # fmt: skip
"""Who else may: a sweep (and a study worker) starts the pools its jobs train on (place/pools.py). The CLI and the run
module reach a pool only through the seam."""


def test_the_entry_points_ask_the_run_and_the_seam_and_not_each_other():
    graph = import_graph()
    assert {"tinker_exp.run", "tinker_exp.place"} <= graph["tinker_exp.pool.host"] | graph["tinker_exp.main"]  # it looks
    assert crossings(graph) == []


def test_the_old_arrangement_fails_the_layer_checks():
    """main.py as the library of run steps (it spoke to the pool itself; pool/host.py ran `main.train_run`), and the
    run module starting pools itself: each found."""
    old = {"tinker_exp.main": {"tinker_exp.place.wire", "tinker_exp.train.loop"},
           "tinker_exp.pool.host": {"tinker_exp.main", "tinker_exp.place.wire"},
           "tinker_exp.run": {"tinker_exp.place.pools"}}  # fmt: skip
    assert crossings(old) == ["tinker_exp.main -> tinker_exp.place.wire", "tinker_exp.pool.host -> tinker_exp.main",
                              "tinker_exp.run -> tinker_exp.place.pools"]  # fmt: skip
    assert layer_of("tinker_exp.main") > layer_of("tinker_exp.pool.host")  # the host's import of main is upward
    assert layer_of("tinker_exp.run") > layer_of("tinker_exp.place") > layer_of("tinker_exp.runtime.warm")


def test_the_import_check_finds_a_circle_and_an_upward_import():
    """The checks themselves, on a made-up graph: optim importing sweep is upward, and a 3-module circle is one."""
    made_up = {"tinker_exp.optim.preview": {"tinker_exp.sweep.report"}, "tinker_exp.sweep.report": {"tinker_exp.train.loop"},
               "tinker_exp.train.loop": {"tinker_exp.optim.preview"}}  # fmt: skip
    assert circles(made_up) == [sorted(made_up)]
    assert layer_of("tinker_exp.sweep.report") > layer_of("tinker_exp.optim.preview")
    assert layer_of("tinker_exp.runtime.ray_cluster") < layer_of("tinker_exp.main")


def test_every_docstring_starts_with_a_one_line_summary():
    """Module, class and function docstrings: one line, or a summary line and a blank one (field docstrings aside)."""
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(REPO / "hydra_plugins" / "tinker_exp_plugins").rglob("*.py")]):
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (ast.get_docstring(node, clean=False) or "").split("\n")
                if len(lines) > 1 and lines[1].strip():
                    offenders.append(f"{where}:{node.body[0].lineno} {getattr(node, 'name', '<module>')}")
    assert offenders == [], "a docstring's second line is not blank:\n" + "\n".join(offenders)
