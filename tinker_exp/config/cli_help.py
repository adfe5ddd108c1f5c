"""`python -m tinker_exp --help`: the parts of conf/hydra/help/tinker_exp.yaml generated from the code.

Through the ``tinker_exp_help`` resolver in the help template: the override keys and the schedule kinds with
their parameters from tinker_exp/optim, the launcher and sweeper options from Hydra's config loader, so the help
cannot drift from what the plan and Hydra accept.
Pure Python; tinker_exp.optim (numpy) is imported only when the help is printed.
"""

from __future__ import annotations

import textwrap
from typing import Callable

RESOLVER = "tinker_exp_help"
"""`${tinker_exp_help:SECTION}` in the help template."""
LINE_WIDTH = 110


def _yaml_word(value: object) -> str:
    """A choice as a user types it (one_cycle's three_phase True is YAML's true)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def overrides_section() -> str:
    """The override keys, then one line per schedule kind: its parameters, `name=default` where it has one."""
    from tinker_exp.optim.convert import OVERRIDE_KEYS
    from tinker_exp.optim.optimizers import TINKER_SPELLINGS
    from tinker_exp.optim.schedules import PARAMS, _defaults

    spellings = ", ".join(f"{tinker} = {ours}" for tinker, ours in TINKER_SPELLINGS.items())
    lines = [
        f"Keys: {', '.join(OVERRIDE_KEYS)} (those the chosen optimizer's groups hold; Tinker's {spellings}).",
        "Each is a number (sent with every step) or a schedule",
        "{schedule: KIND, PARAMETER: VALUE, ...}; betas is [beta1, beta2], each a number or a schedule.",
        "Schedule kinds and their parameters (name=default; [name]: optional; name=optimizer's: the optimizer's",
        "own value for that key when not given or null; every kind also takes total_steps, default trainer.steps):",
    ]
    width = max(map(len, PARAMS))
    choices: dict[str, tuple[object, ...]] = {}
    lengths: dict[str, None] = {}  # in order, once each
    for kind, params in PARAMS.items():
        defaults = _defaults(kind)

        def shown(name: str) -> str:
            if params[name].peak:
                return f"{name}=optimizer's"
            if name not in defaults:
                return name
            return f"[{name}]" if defaults[name] is None else f"{name}={_yaml_word(defaults[name])}"

        choices.update({name: param.choices for name, param in params.items() if param.choices})
        lengths.update({name: None for name, param in params.items() if param.kind in ("length", "lengths")})
        text = f"  {kind.ljust(width)}  {', '.join(shown(name) for name in params)}"
        lines += textwrap.wrap(text, LINE_WIDTH, subsequent_indent=" " * (width + 4), break_on_hyphens=False)
    lines += [f"  {name}: {', '.join(map(_yaml_word, values))}" for name, values in choices.items()]
    lines += textwrap.wrap(
        f"  {', '.join(lengths)}: an integer is a number of steps, a float in [0, 1] a fraction of the schedule",
        LINE_WIDTH, subsequent_indent="    ",
    )  # fmt: skip
    lines += textwrap.wrap(f"  When: {WHEN}", LINE_WIDTH, subsequent_indent="    ")
    return "\n".join(lines)


WHEN = (
    "step 0 is the first step run, total_steps - 1 the last. A warmup starts at step 0 from 0 (wsd's from "
    "min_ratio * value, one_cycle's from value / div_factor) and reaches the peak at step warmup_steps. A decay "
    "(linear, cosine, cosine_restarts, wsd, polynomial) reaches its end or floor at step total_steps, one past the "
    "last step run: the last step sends a value one step short of it (one_cycle, as torch's OneCycleLR, reaches its "
    "floor at the last step). A length that rounds to 0 steps, or a wsd decay of 1 step, says so in a warning."
)
"""When a schedule's phases start and end, in --help (docs/schedules.md says the same)."""


def hydra_groups_section() -> str:
    """The options of the Hydra groups a user picks (launcher, sweeper), from Hydra's config loader."""
    from hydra.core.global_hydra import GlobalHydra

    loader = GlobalHydra.instance().config_loader()
    return "\n".join(f"{group}: {', '.join(sorted(loader.get_group_options(group)))}" for group in HYDRA_GROUPS)


HYDRA_GROUPS = ("hydra/launcher", "hydra/sweeper")
SECTIONS: dict[str, Callable[[], str]] = {"overrides": overrides_section, "hydra_groups": hydra_groups_section}


SHOWN = False
"""Whether this process prints the help (`show_if_asked`): only then are the sections built. Hydra resolves the
template at every compose, twice a command, and the launcher and sweeper options scan its search path: CPU spent
on text nobody reads (with the schema stored once, 0.08 s of a forked dry run's 0.64)."""


def help_section(name: str) -> str:
    return SECTIONS[name]() if SHOWN else ""


def show_if_asked(argv: list[str]) -> None:
    """Set SHOWN: whether Hydra's own parser reads `--help` in these arguments.

    As it will: `-h`, `--help`, or what argparse takes for them."""
    import contextlib
    import io

    from hydra._internal.utils import get_args_parser

    global SHOWN
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # arguments it refuses: Hydra says so itself, once
            SHOWN = bool(get_args_parser().parse_known_args(argv)[0].help)
    except SystemExit:
        SHOWN = False


def register() -> None:
    """The help template's resolver (idempotent)."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver(RESOLVER, help_section, replace=True)
