"""Output shared by every CLI command: one rich table per result, or JSON with ``--json``."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# Columns used when standard output is not a terminal; wide enough for the widest table (the GPU table).
NON_TERMINAL_WIDTH = 200


def terminal_console(*, stderr: bool = False) -> Console:
    """The console every command prints through: the terminal's width, or :data:`NON_TERMINAL_WIDTH` columns
    when the stream is not a terminal (a pipe, a log file, CI), so rich does not fold tables into slivers at
    its default 80 columns."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=NON_TERMINAL_WIDTH)



def to_jsonable(obj: Any) -> Any:
    """Dataclasses, enums, tuples and paths to plain JSON values; non-finite floats become None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def dump_json(obj: Any, path: str | Path | None = None) -> None:
    """Write ``obj`` as indented JSON to ``path``, or to standard output when ``path`` is None."""
    text = json.dumps(to_jsonable(obj), indent=2, sort_keys=False)
    if path is None:
        sys.stdout.write(text + "\n")
    else:
        Path(path).write_text(text + "\n")


def format_value(value: Any, precision: int = 3) -> str:
    """A cell's text: floats to ``precision`` significant digits (whole numbers up to 1e9 in full, with
    thousands separators, never in exponent form), None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if 10**precision <= abs(value) < 1e9:
            return f"{value:,.0f}"
        return f"{value:.{precision}g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    caption: str | None = None,
    console: Console | None = None,
) -> None:
    """Print one table; every cell goes through :func:`format_value`.

    Output that is not a terminal (a pipe, a log file, CI) gets a wide console so that tables are not folded
    into unreadable slivers at rich's default 80 columns.
    """
    table = Table(title=title, caption=caption, show_lines=False)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(format_value(v) for v in row))
    if console is None:
        console = terminal_console()
    console.print(table)


def prepare_output_path(path: str | Path, *, argument: str, create_parents: bool = False) -> Path:
    """Check an output path before any work starts, so a long run never ends by losing its results.

    One rule for every file a command writes: a missing parent folder is created only when it lies inside
    the current working directory (or ``create_parents`` asks for it); anywhere else it is an error naming
    ``argument``. A path that is an existing folder, or whose folder cannot be written, is an error too.
    Returns the path, resolved.
    """
    out = Path(path).expanduser().resolve()
    if out.is_dir():
        raise ValueError(f"{argument}: {path} is a folder; give a file name")
    parent = out.parent
    if not parent.exists():
        cwd = Path.cwd().resolve()
        if not (create_parents or parent.is_relative_to(cwd)):
            raise ValueError(
                f"{argument}: folder {parent} does not exist (folders are created only inside the current "
                "directory); create it first or choose another path"
            )
        parent.mkdir(parents=True, exist_ok=True)
    elif not parent.is_dir():
        raise ValueError(f"{argument}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{argument}: folder {parent} is not writable")
    return out
