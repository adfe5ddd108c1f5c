"""Plain-text formats shared by runs and sweeps; pure Python.

JSON files, JSONL rows (ours, and a user's data and prompt files), right-aligned tables and run dirs' names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from tinker_exp.errors import ConfigError

# user:password@ wherever it stands, in a URL that parses or not (postgresql//bob:pw@host, a quoted repr): the user
# part starts after a space, quote, '=', ':' or '/' (or at the start); the password (never "//...", a scheme's) runs
# to the last '@' before a space or quote: one with '/' or '@' in it is masked whole (a host after it may be too).
_CREDENTIALS = re.compile(r"""(?<![^\s:/@'"=])([^\s:/@'"=]*):(?!//)[^\s'"]*@""")


def masked(text: str) -> str:
    """Text as printed and saved, with the passwords of credentials masked.

    The password of every credential-shaped `user:password@` in it (a study's database URL, parseable or mistyped) is
    replaced by ***."""
    return _CREDENTIALS.sub(r"\1:***@", text)


def display_name(path: Path) -> str:
    """A run or sweep dir as a person names it: below outputs/ (runs/DATE/TIME, sweeps/DATE/TIME/3), else its name."""
    parts = Path(path).resolve().parts
    if "outputs" in parts[:-1]:
        last = len(parts) - 1 - parts[::-1].index("outputs")
        return "/".join(parts[last + 1 :])
    return Path(path).name


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete row; a last line cut short by a kill is skipped (a file is read while it is written)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def jsonl_records(path: Path, key: str) -> Iterator[tuple[str, Any]]:
    """A user's JSONL file (a data set, an env's prompts), record by record: ("FILE:LINE", its JSON value).

    Text that is not UTF-8, or a line that is not JSON, is a ConfigError naming `key` (the setting that names the
    file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{key}: {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: {path}:{lineno}: not valid JSON ({e.msg})") from None


def kind_of(value: Any) -> str:
    """A JSON value's kind as an error names it: null, str, int, list, dict ..."""
    return "null" if value is None else type(value).__name__


def read_json(path: Path) -> Any:
    """The file's JSON value; None when it is missing or not (yet) valid JSON (a run writing or killed)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns under a dashed rule: plan tables and sweep summaries alike."""
    cells = [header] + rows
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def not_a_folder(path: Path) -> str | None:
    """Why `path` cannot be (or be made) a folder: it, or a folder above it, is a file (None: it can).

    Checked before anything is written, for a one-line error instead of mkdir's traceback."""
    for at in (Path(path), *Path(path).parents):
        if at.exists() or at.is_symlink():
            if at.is_dir():
                return None
            what = f"{at} is a file, not a folder" if at.is_file() else f"{at} is not a folder"
            return what if at == Path(path) else f"{what} (in {path})"
    return None
