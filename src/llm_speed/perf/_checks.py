"""Argument checks shared by the performance model and the kernels: one wording for every module's errors.

Torch-free and NumPy-free, so that every layer (the analytic model, the kernels, the compatibility package)
can use them.
"""

from __future__ import annotations

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
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(value)  # numpy.bool_ is named numpy.bool from NumPy 2 on
    hint = " (a tensor: pass tensor.item())" if kind.__module__.startswith("torch") else ""
    raise TypeError(
        f"{name} must be a bool (True or False) or a numpy.bool_, got {type_name(value)} "
        f"{reprlib.repr(value)}{hint}"
    )


def positive_int(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """``value`` as an int if it is an integer > 0 (>= 0 with ``allow_zero``; NumPy integers accepted);
    TypeError for a non-integer (bool and float included), ValueError for a value out of range, both naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'an int >= 0' if allow_zero else 'a positive int'}, got {value}")
    return value


def non_negative_number(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number >= 0 (NumPy scalars accepted); TypeError for a
    non-number, ValueError for a negative, NaN or infinite one, both naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def attention_shape(
    batch: Any, heads_q: Any, seq_q: Any, seq_kv: Any, head_dim: Any, heads_kv: Any
) -> tuple[int, int, int, int, int, int]:
    """Checked (batch, heads_q, seq_q, seq_kv, head_dim, heads_kv): all positive ints, ``heads_kv``
    defaulting (None) to ``heads_q`` and dividing it (GQA/MQA)."""
    batch = positive_int("batch", batch)
    heads_q = positive_int("heads_q", heads_q)
    seq_q = positive_int("seq_q", seq_q)
    seq_kv = positive_int("seq_kv", seq_kv)
    head_dim = positive_int("head_dim", head_dim)
    heads_kv = heads_q if heads_kv is None else positive_int("heads_kv", heads_kv)
    if heads_q % heads_kv:
        raise ValueError(
            f"heads_kv ({heads_kv}) must divide heads_q ({heads_q}); valid heads_kv: {divisors_text(heads_q)}"
        )
    return batch, heads_q, seq_q, seq_kv, head_dim, heads_kv


def divisors_text(value: int) -> str:
    """The divisors of ``value`` as "1, 2, 4, 8" (for error messages that list the valid choices)."""
    return ", ".join(str(x) for x in range(1, value + 1) if value % x == 0)


# The longest context any published model claims: Llama 4 Scout, 10M tokens (Meta, "The Llama 4 herd", 2025).
LONGEST_PUBLISHED_CONTEXT = 10_000_000


def size_warnings(
    tokens: int, *, max_position_embeddings: int | None = None, what: str = "tokens"
) -> list[str]:
    """Warnings for a sequence of ``tokens``: past the model's trained context (max_position_embeddings), and
    past any published model's context (the figures are then arithmetic, not a deployment)."""
    notes = []
    if max_position_embeddings is not None and tokens > max_position_embeddings:
        notes.append(
            f"Warning: {tokens:,} {what} exceed the model's {max_position_embeddings:,}-token context "
            "(max_position_embeddings); costs are still computed."
        )
    if tokens > LONGEST_PUBLISHED_CONTEXT:
        notes.append(
            f"Warning: {tokens:,} {what} is beyond any published model's context "
            f"({LONGEST_PUBLISHED_CONTEXT:,}); the figures are arithmetic, not a deployment."
        )
    return notes
