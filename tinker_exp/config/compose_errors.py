"""Hydra's own compose errors (a wrong type on the CLI, an unknown key or option) as our one-line config errors.

Hydra prints them over several lines and exits 1; every other config error of ours is one line naming the key,
exit 2. Hydra reports through ``hydra._internal.utils.run_and_report``, which is internal API: within
``one_line_compose_errors`` a guard around the function it runs turns those errors into ours first.

The override grammar's mistakes (``override=NAME`` without the ``+``, two ``+override`` flags, a key or schedule
parameter the selected preset does not set, a typo) get a line that says what to type instead of Hydra's words,
which speak of defaults lists and structs. Pure Python.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from tinker_exp.errors import ConfigError, TinkerExpError, one_line, suggest

COMPOSE_ERRORS = (ConfigCompositionException, OverrideParseException, OmegaConfBaseException)


def compose_message(error: BaseException) -> str:
    """One line for a compose error.

    What to type instead for a grammar mistake, else the key and what is wrong with its value (OmegaConf's words), else
    Hydra's first line."""
    grammar = grammar_message(error)
    if grammar is not None:
        return grammar
    if isinstance(error, OverrideParseException):  # the CLI text itself does not parse
        return unreadable_value(error.override) if "LexerNoViableAlt" in error.message else (
            f"{error.override!r}: {error.message.strip().splitlines()[0]}"
        )  # fmt: skip
    cause = error if isinstance(error, OmegaConfBaseException) else error.__cause__
    head = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(cause, OmegaConfBaseException):
        message = (getattr(cause, "msg", None) or str(cause)).strip().splitlines()[0]
        key = getattr(cause, "full_key", None)
        if key:
            return f"{key}: {type_message(message, getattr(cause, 'value', None)) or message}"
        return message if cause is error else f"{head}: {message}"
    return head


def unreadable_value(typed: str) -> str:
    """KEY=VALUE whose value holds a character Hydra's grammar reads only in quotes (~, &, a quote, ...)."""
    key, _, value = typed.partition("=")
    home = f" (or write $HOME{value[1:]}, which the shell expands)" if value.startswith("~") else ""
    return f"{typed}: Hydra reads this value only in quotes: type '{key}=\"{value}\"'{home}"


NOT_CONVERTED = re.compile(r"Value '.*' of type '\w+' could not be converted to (?P<kind>\w+)$")
NOT_A_BOOL = re.compile(r"Value '.*' is not a valid bool")
NOT_AN_OPTION = re.compile(r"Invalid value '.*', expected one of \[(?P<options>.*)\]$")
NOT_OPTIONAL = re.compile(r"field '.*' is not Optional$|Non optional field cannot be assigned None")
KINDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string", "Path": "a path"}


def type_message(message: str, value: Any) -> str | None:
    """OmegaConf's words for a value of the wrong type, in ours: what the key takes and what it got.

    For every typed key: an int, a float, a bool, a choice, a value that may not be null. None: another message."""
    got = f"{value!r} ({type(value).__name__})"
    if match := NOT_CONVERTED.match(message):
        takes = KINDS.get(match.group("kind"), match.group("kind"))
        whole = isinstance(value, float) and value.is_integer() and match.group("kind") == "Integer"
        return f"expected {takes}, got {got}" + (f": write {int(value)}" if whole else "")
    if NOT_A_BOOL.match(message):
        return f"expected true or false, got {got}"
    if match := NOT_AN_OPTION.match(message):
        return f"expected one of {match.group('options')}, got {value!r}"
    if NOT_OPTIONAL.search(message):
        return "expected a value, got null (this key has no null)"
    return None


OVERRIDE = "override"
"""The group of optimizer-override presets (conf/override/), left out of the defaults list on purpose."""
NOT_IN_DEFAULTS = re.compile(r"Could not override '(?P<group>[^']+)'\. No match in the defaults list")
TWICE = re.compile(r"Multiple values for (?P<group>\S+)\. To override a value use")
NEW_KEY = re.compile(r"Could not override '(?P<key>[^']+)'\.")
ALREADY_SET = re.compile(r"Could not append to config\. An item is already at '(?P<key>[^']+)'")
AMBIGUOUS = re.compile(r"Ambiguous value for argument '(?P<arg>[^']+)'")
APPEND_AS = re.compile(r"To append to your (?:config|default list) use \+(?P<text>.+)$", re.MULTILINE)


def grammar_message(error: BaseException, argv: list[str] | None = None) -> str | None:
    """The line for a mistake in the CLI's grammar (None: not one). `argv`: the CLI's arguments (sys.argv[1:])."""
    from hydra.errors import MissingConfigException

    argv = sys.argv[1:] if argv is None else argv  # what Hydra parsed: for the flags its messages leave out
    text = str(error)
    appended = APPEND_AS.search(text)
    typed = appended.group("text").strip() if appended else None
    if (match := NOT_IN_DEFAULTS.match(text)) and typed:
        group = match.group("group")
        typed = next((arg for arg in argv if arg.startswith(f"{group}=")), typed)  # as typed (Hydra's is a repr)
        why = "the + adds the group, which is not in the defaults list on purpose" if group == OVERRIDE else (
            f"the + adds {group}, which is not in the defaults list"
        )  # fmt: skip
        return f"{typed}: type +{typed} ({why})"
    if match := AMBIGUOUS.match(text):
        arg = match.group("arg")
        key, _, values = arg.partition("=")
        if key == f"+{OVERRIDE}":
            return f"{arg}: a comma list is a sweep: add -m (one run per preset), or compose them in one run: {key}=[{values}]"
        if takes_list(key) is False:
            return f"{arg}: a comma list is a sweep: add -m (one run per value; {key.lstrip('+~')} takes one value)"
        return f"{arg}: a comma list is a sweep: add -m (one run per value), or give a list: {key}=[{values}] (a string: {key}='{values}')"
    if (match := TWICE.match(text)) and match.group("group") == OVERRIDE:
        return twice_message(argv)
    if match := ALREADY_SET.match(text):
        key = match.group("key")
        given = next((arg[1:] for arg in argv if arg.startswith(f"+{key}=")), f"{key}=...")
        return f"+{given}: {key} is set already: type {given} (no +; ++{given} sets it either way)"
    if isinstance(error, MissingConfigException) and "/" in (error.missing_cfg_file or ""):  # GROUP/OPTION
        return missing_option_message(error.missing_cfg_file, error.options)
    cause = error.__cause__
    if (match := NEW_KEY.match(text)) and typed and isinstance(cause, OmegaConfBaseException):
        return new_key_message(cause, match.group("key"), typed)
    return None


def takes_list(key: str) -> bool | None:
    """Whether a config key (as typed, + and all) takes a list.

    True or False where the schema (or the override grammar) says, None where it does not know (hydra.*, an untyped
    field, a key that is not there)."""
    import dataclasses
    import typing

    parts = key.lstrip("+~").split(".")
    if parts[0] == OVERRIDE:
        from tinker_exp.optim.schedules import PARAMS

        if len(parts) == 2:  # override.KEY: a value or a schedule; betas a pair
            return parts[1] == "betas"
        lengths = {name for params in PARAMS.values() for name, param in params.items() if param.kind == "lengths"}
        return parts[-1] in lengths  # a schedule parameter: milestones takes a list
    node = schema_type(".".join(parts))
    if node is None or node is Any or dataclasses.is_dataclass(node):
        return None
    return typing.get_origin(node) in (list, tuple)


def schema_type(key: str) -> Any:
    """A config key's type in the schema (Optional[X]: X); None where the schema has no such key."""
    import dataclasses
    import typing

    from tinker_exp.config.schema import Config

    node: Any = Config
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
        while typing.get_origin(node) is typing.Union:  # Optional[X]
            node = next(arg for arg in typing.get_args(node) if arg is not type(None))
    return node


def twice_message(argv: list[str]) -> str:
    names: list[str] = []
    for arg in argv:
        if arg.startswith(f"+{OVERRIDE}="):
            value = arg.split("=", 1)[1].strip()
            names += [n.strip() for n in value.strip("[]").split(",")] if value.startswith("[") else [value]
    given = ", ".join(f"+{OVERRIDE}={n}" for n in names) if names else f"+{OVERRIDE}"
    composed = f"[{','.join(names)}]" if len(names) > 1 else "[a,b]"
    return f"{given}: one +{OVERRIDE} flag only; compose presets in it: +{OVERRIDE}={composed} (a later file wins)"


def missing_option_message(missing: str, options: Iterable[str] | None) -> str:
    group, _, name = missing.rpartition("/")
    known = sorted(options) if options else group_options(group)
    typed = f"+{group}" if group == OVERRIDE else group  # how it is selected
    return f"{typed}={name}: {group} has no option {name}" + (suggest(name, known, "options:") if known else "")


def group_options(group: str) -> list[str]:
    """A config group's options from Hydra's config loader (Hydra lists them only for some errors)."""
    from hydra.core.global_hydra import GlobalHydra

    try:
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    except Exception:  # noqa: BLE001 - the options only decorate the message
        return []


def new_key_message(cause: OmegaConfBaseException, key: str, typed: str) -> str:
    """`typed` (KEY=VALUE as given) names a key the composed config does not have."""
    from tinker_exp.optim.convert import OVERRIDE_KEYS

    parent = getattr(cause, "parent_node", None)
    name = str(getattr(cause, "key", None) or key.rsplit(".", 1)[-1])
    key = getattr(cause, "full_key", None) or key  # the first key that is missing (typed may go deeper)
    siblings = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
    if key == f"{OVERRIDE}.{name}" and not siblings:
        return f"{typed}: no override is selected, so {key} is new: type +{typed} (or select a preset first: +{OVERRIDE}=NAME)"
    if key == f"{OVERRIDE}.{name}":
        if name in OVERRIDE_KEYS:
            return f"{typed}: the selected override does not set {name}: type +{typed} (the + adds a key the file does not set)"
        return f"{key}: not an override key" + suggest(name, OVERRIDE_KEYS, "the keys:")
    if key.startswith(f"{OVERRIDE}.") and "schedule" in siblings:
        return schedule_parameter_message(str(parent["schedule"]), key, name, typed)
    if key.startswith(f"{OVERRIDE}."):
        return f"{key}: not in the selected override: type +{typed} to add it"
    owner = key.rpartition(".")[0]
    if owner.rpartition(".")[2] in OPEN_MAPPINGS:  # a pruner's arguments: each one new, as override keys
        return f"{typed}: {owner} does not set {name}: type +{typed} (the + adds an argument the config does not set)"
    return no_such_key(key, name, [k for k in siblings if k != "hydra"])


OPEN_MAPPINGS = ("pruner_args", "wrapped_args", "sampler_args")
"""Mappings (hydra.sweeper.pruner_args, sampler_args, ...) that start empty: every key in them is added with +."""


def no_such_key(key: str, name: str, known: list[str]) -> str:
    owner = key.rpartition(".")[0] or "the config"
    in_groups = keys_named(name) if owner == "the config" else []
    if in_groups:  # steps=10 means trainer.steps, not plan_steps (the closest top-level name)
        return f"{key}: {owner} has no key {name}; did you mean {' or '.join(in_groups)}?"
    return f"{key}: {owner} has no key {name}" + suggest(name, known, f"{owner}'s keys:")


def keys_named(name: str) -> list[str]:
    """The config's keys called `name`, at the top or in a group: steps -> trainer.steps, lr -> optimizer.lr."""
    import dataclasses
    import typing

    from tinker_exp.config.schema import Config

    found = []
    for field, hint in typing.get_type_hints(Config).items():
        if field == name:
            found.append(name)
        group = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)  # Optional[Group]
        if dataclasses.is_dataclass(group) and name in {f.name for f in dataclasses.fields(group)}:
            found.append(f"{field}.{name}")
    return found


def refuse_unknown_flags(argv: list[str]) -> None:
    """A flag Hydra's parser does not know (`--dry-run`, `--steps 10`): one line that says how a key is set.

    Said instead of argparse's usage and exit 2, which name the program __main__.py."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    _, unknown = parser.parse_known_args(argv)
    flag = next((arg for arg in unknown if arg.startswith("-")), None)
    if flag is None:
        return
    name, _, value = flag.lstrip("-").partition("=")
    keys = [name] if "." in name else keys_named(name.replace("-", "_"))  # --trainer.steps=3, --dry-run
    if keys:
        typed = f"{keys[0]}={value or ('true' if schema_type(keys[0]) is bool else 'VALUE')}"  # --dry-run: dry_run=true
        raise ConfigError(f"{flag}: not a flag: a key is set as KEY=VALUE, as in {typed}")
    flags = [max(action.option_strings, key=len) for action in parser._actions if action.option_strings]
    raise ConfigError(f"{flag}: not a flag" + suggest(flag, flags, "flags:") + "; keys are set as KEY=VALUE")


def unknown_key(node: Any, where: str = "") -> str | None:
    """The line for the first key of a typed group that its dataclass lacks; None when there is none.

    `+trainer.stpes=3` composes, and OmegaConf.to_object would drop it silently. Interpolations are left unresolved."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if schema is None or not dataclasses.is_dataclass(schema):
        return None
    known = [field.name for field in dataclasses.fields(schema)]
    for name, child in node.items_ex(resolve=False):
        key = f"{where}.{name}" if where else str(name)
        if name not in known:
            return no_such_key(key, str(name), known)
        found = unknown_key(child, key)
        if found:
            return found
    return None


def schedule_parameter_message(kind: str, key: str, name: str, typed: str) -> str:
    """A parameter of a schedule mapping that the selected preset does not set."""
    from tinker_exp.optim.schedules import PARAMS

    if kind not in PARAMS:
        return f"{key}: not in the selected override: type +{typed} to add it"
    takes = [*PARAMS[kind], "total_steps"]  # every kind takes total_steps (default: trainer.steps)
    if name in PARAMS[kind] or name == "total_steps":
        return f"{typed}: the selected override does not set {name}: type +{typed} (the + adds a parameter the file does not set)"
    owners = [other for other, params in PARAMS.items() if name in params]
    if owners:
        schedule = f"{typed.partition('=')[0].rpartition('.')[0]}.schedule"  # as typed: betas.1, not betas[1]
        return (
            f"{key}: {name} is a parameter of {', '.join(owners)}, not of {kind} ({schedule}); {kind} takes "
            f"{', '.join(takes)}; to switch kinds: {schedule}={owners[0]} +{typed}"
        )
    return f"{key}: {kind} has no parameter {name}" + suggest(name, takes, f"{kind} takes")


def config_dir_message(argv: list[str]) -> str:
    """--config-dir (-cd) DIR as typed, and why it is no config dir."""
    from pathlib import Path

    from tinker_exp.formats import not_a_folder

    flag, given = "--config-dir", ""
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            flag, given = arg, argv[i + 1]
        elif arg.startswith("--config-dir="):
            given = arg.partition("=")[2]
    where = "" if Path(given).is_absolute() else f" ({Path(given).absolute()})"
    return f"{flag} {given}: {not_a_folder(Path(given)) or 'no such folder' + where}"


UNEXPECTED = re.compile(r"unexpected keyword argument '(?P<name>[^']+)'")
TARGET = re.compile(r"Error in call to target '(?P<target>[^']+)'")
FULL_KEY = re.compile(r"full_key: (?P<key>\S+)")


def unknown_argument(error: BaseException) -> str | None:
    """The line for a key its plugin does not take: the key as typed, and the keys the plugin takes.

    E.g. `+hydra.sweeper.kappa=2.0`: Hydra's "Error in call to target ... unexpected keyword argument", over several
    lines. The keys the plugin takes are its constructor's. None for any other error."""
    import inspect

    from hydra.utils import get_class

    text = str(error)
    unexpected, target, full_key = UNEXPECTED.search(str(error.__cause__)), TARGET.search(text), FULL_KEY.search(text)
    if not (isinstance(error.__cause__, TypeError) and unexpected and target and full_key):
        return None
    try:
        takes = inspect.signature(get_class(target.group("target"))).parameters.values()
    except Exception:  # noqa: BLE001 - a target that cannot be looked up: Hydra's own words stay
        return None
    known = [p.name for p in takes if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    name = unexpected.group("name")
    return no_such_key(f"{full_key.group('key')}.{name}", name, known)


def as_config_error(error: BaseException) -> ConfigError:
    return ConfigError(compose_message(error))


@contextmanager
def one_line_compose_errors() -> Iterator[None]:
    from hydra._internal import utils as hydra_utils
    from hydra.errors import InstantiationException, SearchPathException

    original = hydra_utils.run_and_report

    def stop(error: TinkerExpError) -> None:
        print(f"tinker_exp: {one_line(error)}", file=sys.stderr)
        sys.exit(error.exit_code)

    def run_and_report(func: Callable[[], Any]) -> Any:
        def guarded() -> Any:
            try:
                return func()
            except InstantiationException as e:  # a launcher or sweeper refusing its keys: ours in one line
                if isinstance(e.__cause__, TinkerExpError):
                    stop(e.__cause__)
                if (line := unknown_argument(e)) is None:
                    raise
                stop(ConfigError(line))
            except (*COMPOSE_ERRORS, TinkerExpError) as e:  # ours too: a sweeper's config error (its search space)
                stop(e if isinstance(e, TinkerExpError) else as_config_error(e))
            except SearchPathException:  # the only one Hydra raises before composing: --config-dir is not a folder
                stop(ConfigError(config_dir_message(sys.argv[1:])))

        return original(guarded)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    except COMPOSE_ERRORS as e:  # --help composes outside run_and_report
        stop(as_config_error(e))
    except ConfigError as e:  # raised before Hydra runs: an unknown flag
        stop(e)
    finally:
        hydra_utils.run_and_report = original
