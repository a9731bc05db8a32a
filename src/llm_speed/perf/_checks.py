"""Argument checks of the performance model: problem shapes and size warnings (the plain checks of flags,
integers and numbers are the foundation's, :mod:`llm_speed.core.args`)."""

from __future__ import annotations

from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.gpus import normalize_dtype


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
    return batch, heads_q, seq_q, seq_kv, head_dim, grouped_heads(heads_q, heads_kv)


def grouped_heads(heads_q: int, heads_kv: Any) -> int:
    """Checked ``heads_kv`` of ``heads_q`` query heads: a positive int dividing it (GQA/MQA), None giving
    ``heads_q``."""
    heads_kv = heads_q if heads_kv is None else positive_int("heads_kv", heads_kv)
    if heads_q % heads_kv:
        raise ValueError(
            f"heads_kv ({heads_kv}) must divide heads_q ({heads_q}); valid heads_kv: {divisors_text(heads_q)}"
        )
    return heads_kv


def distinct_experts(top_k: int, experts: int) -> int:
    """``top_k``, refused (ValueError naming it) past ``experts``: a token picks top_k distinct experts."""
    if top_k > experts:
        raise ValueError(f"top_k = {top_k} exceeds experts = {experts}: a token picks top_k distinct experts")
    return top_k


def check_dtype(name: str, value: Any) -> str:
    """``value`` (a dtype of an argument other than ``dtype``: ``out_dtype``, ``kv_dtype``) as its canonical
    name; ValueError naming ``name`` and the accepted dtypes."""
    try:
        return normalize_dtype(value)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def missing_path(path: Any, want: str) -> str:
    """Why ``path`` is not the ``want`` ("file" or "folder") an argument needs: "not found", or what it is
    instead (a folder given for a file says so rather than "file not found")."""
    from pathlib import Path

    found = Path(path).expanduser()
    if found.is_dir() and want == "file":
        return "is a folder, not a file"
    if found.exists() and want == "folder":
        return "is a file, not a folder" if found.is_file() else "is not a folder"
    if found.exists() and not found.is_file():
        return "is not a regular file"
    return f"{want} not found"


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
