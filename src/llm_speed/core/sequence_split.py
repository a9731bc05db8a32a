"""How a sequence is split across the ranks of context parallelism: one definition, shared by ring attention
(:mod:`llm_speed.distributed`) and the analytic model that prices it (:mod:`llm_speed.perf.context_parallel`).

``contiguous``: rank r holds chunk r of W. ``zigzag``: the sequence is cut into 2W chunks and rank r holds
chunks r and 2W-1-r, so under a causal mask every rank does the same work (zhuzilin/ring-flash-attention).
Torch-free.
"""

from __future__ import annotations

from typing import Any

from llm_speed.core.args import positive_int

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def sequence_chunk_lengths(seq_len: int, world: int, layout: str) -> list[int]:
    """The W (contiguous) or 2W (zigzag) chunk lengths of a ``seq_len`` sequence, ``torch.tensor_split``
    style: the first ``seq_len mod chunks`` chunks are one token longer. Every chunk needs a token."""
    seq_len = positive_int("seq_len", seq_len)
    world = positive_int("world_size", world)
    chunks = 2 * world if check_layout(layout) == "zigzag" else world
    if seq_len < chunks:
        raise ValueError(
            f"seq_len ({seq_len}) must be at least {chunks}: layout {layout!r} on {world} ranks cuts the "
            f"sequence into {chunks} chunks of at least one token"
        )
    base, extra = divmod(seq_len, chunks)
    return [base + 1 if i < extra else base for i in range(chunks)]


def rank_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in shard order: (r,) contiguous, (r, 2W-1-r) zigzag."""
    return (rank, 2 * world - 1 - rank) if check_layout(layout) == "zigzag" else (rank,)


def shard_lengths(seq_len: int, world: int, layout: str) -> list[int]:
    """Tokens each of the ``world`` ranks holds."""
    lengths = sequence_chunk_lengths(seq_len, world, layout)
    return [sum(lengths[c] for c in rank_chunks(r, world, layout)) for r in range(world)]
