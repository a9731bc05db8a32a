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


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """``value`` if it is one of ``choices``, else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name} is {value!r}; accepted: {', '.join(map(repr, choices))}")
    return value
