"""Checks of plain arguments (flags, integers, real numbers, choices): one wording for every error.

Torch-free and NumPy-free, so every layer uses them: the kernels and ops, the analytic model (which imports no
torch), the compatibility package. Each check returns the value in its Python type (a NumPy integer comes back
as an ``int``), or raises TypeError (wrong type) or ValueError (out of range) naming the argument.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any


def type_name(value: Any) -> str:
    """``value``'s type as a user would write it: ``int``, ``str``, ``numpy.int64`` (not just ``int64``)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool if it is a real ``bool`` or a NumPy bool; TypeError naming ``name`` for anything
    else.

    Truthiness is not enough: ``is_causal="no"``, ``trans_b=0.0`` or ``is_causal=1`` are almost always
    mistakes. Tensors are refused too, 0-d bool ones included: turning one into a Python bool waits for the
    device and breaks a ``torch.compile`` graph; pass ``flag.item()`` where that is meant.
    """
    if value is True or value is False:
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)  # numpy.bool_ is named numpy.bool from NumPy 2 on
    hint = " (a tensor: pass tensor.item())" if kind.__module__.startswith("torch") else ""
    raise TypeError(
        f"{name} must be a bool (True or False) or a numpy.bool_, got {type_name(value)} "
        f"{reprlib.repr(value)}{hint}"
    )


def check_int(name: str, value: Any) -> int:
    """``value`` as an int if it is an integer of any sign (NumPy integers accepted; bools refused), else
    TypeError naming ``name``."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type_name(value)} {reprlib.repr(value)}")
        value = int(value)
    return value


def positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """``value`` as an int if it is an integer > 0 (>= 0 with ``allow_zero``; NumPy integers accepted);
    TypeError for a non-integer (bool and float included), ValueError for a value out of range, both naming
    ``name``."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'an int >= 0' if allow_zero else 'a positive int'}, got {value}")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
) -> float:
    """``value`` as a float if it is a finite real number (bools refused, NumPy scalars accepted), optionally
    > 0 (``positive``) and within ``[minimum, maximum]``; TypeError or ValueError naming ``name``."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type_name(value)} {reprlib.repr(value)}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def non_negative_number(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number >= 0 (NumPy scalars accepted); TypeError for a
    non-number, ValueError for a negative, NaN or infinite one, both naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def positive_ints(name: str, value: Any, *, lengths: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints > 0 if it is a tuple or list of one of ``lengths`` (NumPy integers
    accepted; bools, floats and strings refused, never truncated): a tile or a kernel configuration. TypeError
    (not a sequence of ints) or ValueError (wrong length, an entry <= 0) naming ``name`` and what is accepted
    (``what``: the entries' names, as "BM, BN, BK[, warps]")."""
    accepted = f"{' or '.join(map(str, lengths))} positive ints ({what})"
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be {accepted}, got {type_name(value)} {reprlib.repr(value)}")
    if len(value) not in lengths:
        raise ValueError(f"{name} must be {accepted}, got {len(value)}: {reprlib.repr(value)}")
    for entry in value:
        if isinstance(entry, bool) or not isinstance(entry, numbers.Integral):
            raise TypeError(f"{name} must be {accepted}, got {type_name(entry)} {entry!r} in {value!r}")
        if entry <= 0:
            raise ValueError(f"{name} must be {accepted}, got {entry} in {tuple(value)!r}")
    return tuple(int(entry) for entry in value)


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """``window``: None, or ``(left, right)`` with each an int >= 0 or None (unbounded on that side).

    Returns it as a tuple of plain ints / None (NumPy integers accepted); anything else is a clear error
    naming ``window``. Torch-free: the attention kernels and the analytic model check it alike.
    """
    if window is None:
        return None
    if type(window) is tuple and len(window) == 2:  # the common spelling, checked at the cost of a lookup
        left, right = window
        if (left is None or type(left) is int and left >= 0) and (
            right is None or type(right) is int and right >= 0
        ):
            return window
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window {name} must be an int >= 0 or None, got {type(side).__name__}")
        if side < 0:
            raise ValueError(f"window {name} must be >= 0 or None, got {side}")
        sides.append(int(side))
    return sides[0], sides[1]


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``, else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name} is {value!r}; accepted: {', '.join(map(repr, choices))}")
    return value
