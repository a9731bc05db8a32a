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
        return
    write_text_atomic(path, text + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """``text`` (UTF-8, newlines as given) written to ``path`` through a temporary file beside it that then
    replaces it: a run cut during the write (the bench commands rewrite their JSON and CSV after every case)
    keeps the previous file whole rather than a truncated one. A link's target is replaced, not the link;
    /dev/stdout or a pipe is written in place (nothing there to replace)."""
    path = Path(path).resolve()
    if path.exists() and not path.is_file():
        path.write_text(text, encoding="utf-8", newline="")
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8", newline="")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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


def prepare_plot_path(path: str | Path, *, argument: str = "--plot", made: list[Path] | None = None) -> Path:
    """:func:`prepare_output_path` for a figure, whose extension must also be a file type matplotlib writes
    (png, pdf, svg, ...): checked before the work, where matplotlib would refuse it only at the end."""
    from matplotlib.backend_bases import FigureCanvasBase

    supported = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().removeprefix(".")
    if Path(path).is_dir():
        example = Path(path) / "plot.png"
        raise ValueError(f"{argument}: {path} is a folder; give a file name in it, e.g. {example}")
    if suffix not in supported:
        what = f"ends in .{suffix}, a file type matplotlib does not write" if suffix else "has no extension"
        raise ValueError(f"{argument}: {path} {what}; accepted: {', '.join(sorted(supported))}")
    return prepare_output_path(path, argument=argument, made=made)


def prepare_output_path(
    path: str | Path, *, argument: str, create_parents: bool = False, made: list[Path] | None = None
) -> Path:
    """Check an output path before any work starts, so a long run never ends by losing its results.

    One rule for every file a command writes: a missing parent folder is created only when it lies inside
    the current working directory (or ``create_parents`` asks for it); anywhere else it is an error naming
    ``argument``. A path that is an existing folder, or that cannot be opened for writing, is an error too:
    the file is opened (for appending, so an existing file keeps its content) and removed again when it did
    not exist, since a permission check alone passes for root and for paths such as ``/proc/x``.
    Returns the path, resolved. ``made``: a list the folders created are appended to, outermost first, so
    that a command refused after this check can remove them again (:func:`remove_made_folders`).
    """
    out = Path(path).expanduser().resolve()
    if out.is_dir():
        raise ValueError(f"{argument}: {path} is a folder; give a file name")
    parent = out.parent
    created: list[Path] = []  # by this call, outermost first
    if not parent.exists():
        cwd = Path.cwd().resolve()
        if not (create_parents or parent.is_relative_to(cwd)):
            raise ValueError(
                f"{argument}: folder {parent} does not exist (folders are created only inside the current "
                "directory); create it first or choose another path"
            )
        missing = [folder for folder in (parent, *parent.parents) if not folder.exists()]
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            remove_made_folders([folder for folder in reversed(missing) if folder.exists()])
            reason = error.strerror or error
            raise ValueError(f"{argument}: cannot create folder {parent}: {reason}") from None
        created = list(reversed(missing))
    elif not parent.is_dir():
        raise ValueError(f"{argument}: {parent} is not a folder")
    existed = out.exists()
    try:
        with open(out, "a"):
            pass
    except OSError as error:
        remove_made_folders(created)
        raise ValueError(f"{argument}: cannot write {path}: {error.strerror or error}") from None
    if not existed:
        out.unlink(missing_ok=True)
    if made is not None:
        made.extend(created)
    return out


def prepare_output_folder(path: str | Path, *, argument: str) -> Path:
    """Check a folder a command writes files into, before any work starts; returns it, resolved.

    The folder is made when missing if its own parent exists (the user named it) or it lies inside the
    current directory, as :func:`prepare_output_path` makes parents; a file can then be created in it (one is
    created and removed again), or the error names ``argument``.
    """
    out = Path(path).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{argument}: {path} is a file; give a folder")
    prepare_output_path(out / ".llm-speed-write-check", argument=argument, create_parents=out.parent.is_dir())
    return out


def remove_made_folders(made: list[Path]) -> None:
    """Remove the folders :func:`prepare_output_path` created (``made``), innermost first, where they are
    still empty: a command refused after its output check leaves no trace (a folder holding a result,
    or anything else, stays)."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:  # not empty, or already gone
            pass
    made.clear()
