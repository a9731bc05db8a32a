"""How a sequence is split over the ranks of a context-parallel group, and the collective shape check.

Two layouts, as in zhuzilin/ring-flash-attention and Megatron-LM's context parallelism
(``megatron/core/transformer/dot_product_attention`` with ``cp_comm_type="p2p"``):

* ``"contiguous"``: the sequence is cut into W chunks; rank r holds chunk r.
* ``"zigzag"``: the sequence is cut into 2W chunks; rank r holds chunks r and 2W-1-r, in that order, so every
  rank gets the same amount of causal work (Brandon et al., "Striped Attention", arXiv:2311.09431, discuss
  the imbalance this fixes).

Any sequence length S with at least one token per chunk (S >= W, or S >= 2W for zigzag) is accepted:
chunk sizes follow ``torch.tensor_split``, the first ``S mod chunks`` chunks one token longer. No padding.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

# One definition of the split, shared with the analytic model that prices it.
from llm_speed.core.sequence_split import (  # noqa: F401 (LAYOUTS: re-exported by the package)
    LAYOUTS,
    check_layout,
    rank_chunks,
    shard_lengths,
)
from llm_speed.core.sequence_split import sequence_chunk_lengths as chunk_lengths


def chunk_starts(lengths: Sequence[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


# --- the process group ---


def resolve_group(group):
    """(group, rank in group, world size of group); ValueError naming ``group`` when there is none."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("group: this PyTorch build has no torch.distributed support")
    if not dist.is_initialized():
        raise ValueError(
            "group: no process group is initialised; call torch.distributed.init_process_group() first "
            "(torchrun sets up the environment it reads)"
        )
    # What dist.new_group returns on a rank outside the new group: a sentinel, not a group.
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "group: this process is not a member of the given process group (torch.distributed.new_group "
            "returned GroupMember.NON_GROUP_MEMBER here; call ring attention only on the group's ranks)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


def comm_device(group) -> torch.device:
    """Device of the small tensors exchanged to agree on shapes: NCCL needs CUDA, every other backend CPU."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, world: int, rank: int, values: Sequence[float] | None, error: Exception | None, width: int):
    """All-gather each rank's ``values`` (``width`` numbers) before any other communication.

    A rank whose own checks failed passes its ``error`` and still takes part, so no rank is left waiting in a
    later collective: every rank then raises (the failing one its own error, the others a ValueError naming
    the failing ranks). Returns a ``[world, width]`` float64 CPU tensor. Values must be exact in float64.
    """
    import torch.distributed as dist

    row = torch.zeros(width + 1, dtype=torch.float64)
    if error is None:
        row[1:] = torch.tensor([float(x) for x in values], dtype=torch.float64)
    else:
        row[0] = 1
    device = comm_device(group)
    rows = [torch.empty_like(row, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device), group=group)
    table = torch.stack([r.cpu() for r in rows])
    failed = [i for i in range(world) if table[i, 0] != 0]
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"ranks {failed} of the group rejected their input (see the error on those ranks)")
    return table[:, 1:]


def check_dim(dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim must be in [{-ndim}, {ndim - 1}] for a {ndim}-dim tensor, got {dim}")
    return int(dim) % ndim


# --- shard and gather ---


def shard_sequence(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (the same tensor on every rank), along ``dim``.

    ``layout="contiguous"``: rank r gets tokens [r*S/W, (r+1)*S/W); ``"zigzag"``: chunks r and 2W-1-r of 2W
    (see :mod:`llm_speed.distributed.layout` for lengths that do not divide evenly). The result is a new
    contiguous tensor and keeps autograd history (the gradient flows back into ``x``). No communication.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    layout = check_layout(layout)
    dim = check_dim(dim, x.dim())
    _, rank, world = resolve_group(group)
    lengths = chunk_lengths(x.shape[dim], world, layout)
    starts = chunk_starts(lengths)
    pieces = [x.narrow(dim, starts[c], lengths[c]) for c in rank_chunks(rank, world, layout)]
    return torch.cat(pieces, dim=dim).contiguous()


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
MAX_GATHER_DIMS = 8


def gather_sequence(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (inverse of :func:`shard_sequence`), on every rank.

    Shapes are exchanged first: every rank raises ValueError, instead of hanging or mixing data, when the
    shards disagree in dtype, in any dim other than ``dim`` or in lengths that ``layout`` cannot produce.
    An all-gather; the result carries no autograd history. dtypes: float16/32/64, bfloat16, int32/64.
    """
    group, rank, world = resolve_group(group)
    error, values = None, None
    try:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; accepted: {', '.join(map(str, _DTYPES))}")
        if not 1 <= x.dim() <= MAX_GATHER_DIMS:
            raise ValueError(f"x must have 1 to {MAX_GATHER_DIMS} dims, got {x.dim()}")
        layout = check_layout(layout)
        dim = check_dim(dim, x.dim())
        shape = list(x.shape) + [-1] * (MAX_GATHER_DIMS - x.dim())
        values = [x.dim(), dim, _DTYPES.index(x.dtype), *shape]
    except (TypeError, ValueError) as caught:
        error = caught
    table = agree(group, world, rank, values, error, 3 + MAX_GATHER_DIMS)
    outside = torch.cat([table[:, : 3 + dim], table[:, 4 + dim :]], dim=1)
    for r in range(1, world):  # every rank compares with rank 0, so all raise the same error
        if not torch.equal(outside[r], outside[0]):
            raise ValueError(
                f"gather_sequence: rank {r}'s shard (dims, dtype or shape outside dim {dim}) differs from "
                "rank 0's; every rank must pass a shard of the same tensor"
            )
    lengths_held = [int(v) for v in table[:, 3 + dim]]
    expected = shard_lengths(sum(lengths_held), world, layout)
    if lengths_held != expected:
        raise ValueError(
            f"gather_sequence: shard lengths {lengths_held} along dim {dim} are not a {layout!r} split of "
            f"{sum(lengths_held)} tokens over {world} ranks (expected {expected})"
        )
    import torch.distributed as dist

    device = comm_device(group)
    longest = max(lengths_held)
    padded = x.new_zeros(x.shape[:dim] + (longest,) + x.shape[dim + 1 :], device=device)
    padded.narrow(dim, 0, x.shape[dim]).copy_(x.detach())
    buffers = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(buffers, padded, group=group)
    lengths = chunk_lengths(sum(lengths_held), world, layout)
    chunks: dict[int, torch.Tensor] = {}
    for r, buffer in enumerate(buffers):
        offset = 0
        for c in rank_chunks(r, world, layout):
            chunks[c] = buffer.narrow(dim, offset, lengths[c])
            offset += lengths[c]
    return torch.cat([chunks[c] for c in range(len(lengths))], dim=dim).to(x.device)
