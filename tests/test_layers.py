"""The layers hold: the pure packages import no torch, verl, ray or transformers; only the runtime imports them."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "tinker_exp"
HEAVY = ("torch", "verl", "ray", "transformers", "tokenizers", "peft")
PURE = ["tinker_exp.config", "tinker_exp.optim", "tinker_exp.train", "tinker_exp.sweep", "tinker_exp.errors",
        "tinker_exp.formats", "tinker_exp.main", "hydra_plugins.tinker_exp_plugins"]  # fmt: skip


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
