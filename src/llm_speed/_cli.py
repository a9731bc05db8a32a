"""Pieces shared by every ``llm-speed`` command, below all of them: ``--device`` and its resolution, integer
and ``MxNxK`` argument types, the console, and the error class for bad command-line input.

Nothing here imports torch at module level (commands that need no kernel start without it), and nothing
here imports a command module: every command imports down to this file, never across or up.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from llm_speed._output import terminal_console as console  # noqa: F401 (commands print through it)

if TYPE_CHECKING:  # annotations only: torch is imported when a device is resolved
    import torch

DEVICE_CHOICES = ("cuda", "cpu")

_GEMM_SIZE = re.compile(r"^\s*(\d+)\s*[xX×,]\s*(\d+)\s*[xX×,]\s*(\d+)\s*$")


class CommandError(ValueError):
    """Bad command-line input found after parsing: ``llm-speed`` prints the message and exits with 2.

    A ValueError, so library-level validation (which raises ValueError naming the argument) reaches the
    user the same way; any other exception is a bug and keeps its traceback.
    """


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """The one ``--device`` option of every command that runs kernels."""
    parser.add_argument("--device", choices=DEVICE_CHOICES, help="default: cuda when available, else cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """:func:`llm_speed.core.runtime.resolve_device`: the one rule, shared with the profiler and the timer."""
    from llm_speed.core.runtime import resolve_device as resolve

    return resolve(device)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _integer(text, minimum=1, expected="a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, minimum=0, expected="an integer >= 0")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (float("inf") parses, but no measured time or rate is infinite)."""
    return _number(text, lambda value: 0 < value < float("inf"), "a finite number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number(text, lambda value: 0 <= value < float("inf"), "a finite number >= 0")


def fraction(text: str) -> float:
    """argparse type: a share of a peak, in (0, 1]."""
    return _number(text, lambda value: 0 < value <= 1, "a number in (0, 1]")


def _number(text: str, accepted, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not accepted(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def bounded_int(minimum: int, maximum: int):
    """argparse type: an integer from ``minimum`` to ``maximum`` (a run count past which nothing changes)."""

    def parse(text: str) -> int:
        expected = f"an integer from {minimum} to {maximum}"
        return _integer(text, minimum=minimum, maximum=maximum, expected=expected)

    parse.__name__ = f"integer from {minimum} to {maximum}"
    return parse


def _integer(text: str, *, minimum: int, expected: str, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def parse_gemm_size(text: str, *, argument: str = "size") -> tuple[int, int, int]:
    """``'MxNxK'`` (or ``'M,N,K'``) -> ``(M, N, K)``, each >= 1; ValueError naming ``argument`` otherwise."""
    match = _GEMM_SIZE.match(text)
    if match is None:
        raise ValueError(
            f"{argument}: {text!r} is not of the form MxNxK (or M,N,K) with positive integers "
            "(e.g. 1024x1024x1024)"
        )
    m, n, k = (int(part) for part in match.groups())
    if min(m, n, k) < 1:
        raise ValueError(f"{argument}: {text!r} has a zero dimension; M, N and K must be >= 1")
    return m, n, k


def gemm_size(text: str) -> tuple[int, int, int]:
    """argparse type for a GEMM problem size, ``MxNxK`` or ``M,N,K``."""
    try:
        return parse_gemm_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("size: ")) from None
