"""Context-parallel ring attention over ``torch.distributed``, on llm-speed's flash kernels.

Algorithm: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv:2310.01889); the zigzag layout and the per-step block choice as in zhuzilin/ring-flash-attention
(``zigzag_ring_flash_attn.py``) and Megatron-LM's context parallelism. Each rank keeps its query shard; the
K/V shards travel once around the ring (rank r sends to r+1, receives from r-1). The transfer of the next
block is started (``batch_isend_irecv``) before the flash kernel runs on the current one and waited on after,
so it can hide under the compute. Partial results are merged exactly through their log-sum-exp:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

Backward: the flash backward kernels take the *global* output and LSE, which makes each block's gradient
exact on its own; dQ stays home, dK/dV accumulate (in float32) in a buffer that travels the ring with its
K/V block and arrives back at its owner after W steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import flash as _flash
from ..attention.checks import prepare_attention_inputs
from ..core.args import check_flag
from . import layout as _layout


@dataclass(frozen=True)
class SentMessage:
    """One point-to-point send of ring attention: ``what`` is "kv" (K and V stacked) or "dkv" (their
    float32 gradient accumulators); ``step`` counts from 0 within the ``phase`` ("forward"/"backward")."""

    phase: str
    step: int
    what: str
    nbytes: int


# Every message this process sent, in order, for tests and for the model check.
_sent: list[SentMessage] = []


def sent_messages() -> list[SentMessage]:
    """A copy of the messages this process has sent since :func:`clear_sent_messages`."""
    return list(_sent)


def clear_sent_messages() -> None:
    _sent.clear()


@dataclass(frozen=True)
class _Plan:
    group: object
    rank: int
    world: int
    layout: str
    is_causal: bool
    scale: float
    shard_lengths: tuple[int, ...]  # tokens each rank holds
    chunk_lengths: tuple[int, ...]  # the W or 2W chunks

    @property
    def next_rank(self) -> int:
        return self._global((self.rank + 1) % self.world)

    @property
    def prev_rank(self) -> int:
        return self._global((self.rank - 1) % self.world)

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)

    def block(self, source: int):
        """(query rows, key columns, causal) of the work against the K/V shard of rank ``source``, or None
        when every key of it lies in the future of every local query."""
        everything = slice(None)
        if not self.is_causal:
            return everything, everything, False
        if source == self.rank:  # own shard: chunk order is sequence order, so a causal mask is exact
            return everything, everything, True
        if self.layout == "contiguous":
            return (everything, everything, False) if source < self.rank else None
        # zigzag: source < rank -> its first chunk is in the past of both local chunks, its second in the
        # future of both; source > rank -> both its chunks are in the past of the local second chunk only.
        if source < self.rank:
            return everything, slice(0, self.chunk_lengths[source]), False
        return slice(self.chunk_lengths[self.rank], None), everything, False


class _Ring:
    """Start the exchange with the ring neighbours; ``wait`` returns the received buffer."""

    def __init__(self, plan: _Plan, phase: str):
        self.plan, self.phase = plan, phase

    def start(self, send: torch.Tensor, recv_shape, step: int, what: str):
        import torch.distributed as dist

        recv = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
        tag = 0 if what == "kv" else 1  # kv and dkv can be in flight together between the same pair
        ops = [
            dist.P2POp(dist.isend, send, self.plan.next_rank, self.plan.group, tag),
            dist.P2POp(dist.irecv, recv, self.plan.prev_rank, self.plan.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        _sent.append(SentMessage(self.phase, step, what, send.numel() * send.element_size()))
        return works, recv

    @staticmethod
    def wait(pending) -> torch.Tensor:
        works, recv = pending
        for work in works:
            work.wait()
        return recv


def _kv_shape(k: torch.Tensor, seq: int) -> tuple[int, ...]:
    return (2, k.shape[0], k.shape[1], seq, k.shape[3])


def _merge(out, lse, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the float32 running result, exactly (rows that saw nothing stay 0)."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    shift = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = torch.exp(old_lse - shift).unsqueeze(-1)
    new_weight = torch.exp(block_lse - shift).unsqueeze(-1)
    out[:, :, rows] = out[:, :, rows] * old_weight + block_out.float() * new_weight
    lse[:, :, rows] = new_lse


def _ring_forward(q, k, v, plan: _Plan):
    ring = _Ring(plan, "forward")
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    for step in range(plan.world):
        source = (plan.rank - step) % plan.world
        pending = None
        if step < plan.world - 1:
            incoming = plan.shard_lengths[(source - 1) % plan.world]
            pending = ring.start(kv, _kv_shape(k, incoming), step, "kv")
        block = plan.block(source)
        if block is not None:
            rows, cols, causal = block
            block_out, block_lse = _flash.forward_op(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], is_causal=causal, scale=plan.scale
            )
            _merge(out, lse, rows, block_out, block_lse)
        if pending is not None:
            kv = ring.wait(pending)
    return out.to(q.dtype), lse


def _ring_backward(dout, dlse, q, k, v, out, lse, plan: _Plan):
    ring = _Ring(plan, "backward")
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    pending_dkv = None
    for step in range(plan.world):
        source = (plan.rank - step) % plan.world
        pending_kv = None
        if step < plan.world - 1:
            incoming = plan.shard_lengths[(source - 1) % plan.world]
            pending_kv = ring.start(kv, _kv_shape(k, incoming), step, "kv")
        block = plan.block(source)
        grads = None
        if block is not None:
            rows, cols, causal = block
            grads = _flash.backward_op(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                None if dlse is None else dlse[:, :, rows],
                is_causal=causal,
                scale=plan.scale,
            )
            dq[:, :, rows] += grads[0].float()
        # The accumulator of this K/V block arrives from the previous rank (who worked on it last step).
        if pending_dkv is None:
            dkv = torch.zeros(_kv_shape(k, plan.shard_lengths[source]), dtype=torch.float32, device=q.device)
        else:
            dkv = ring.wait(pending_dkv)
        if grads is not None:
            dkv[0][:, :, cols] += grads[1].float()
            dkv[1][:, :, cols] += grads[2].float()
        if plan.world > 1:
            incoming = plan.shard_lengths[(source - 1) % plan.world]
            pending_dkv = ring.start(dkv, _kv_shape(k, incoming), step, "dkv")
        if pending_kv is not None:
            kv = ring.wait(pending_kv)
    if pending_dkv is not None:  # after W steps the accumulator of our own K/V is back home
        dkv = ring.wait(pending_dkv)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = _ring_forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(dout.contiguous(), dlse, q, k, v, out, lse, ctx.plan)
        return dq, dk, dv, None


_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
):
    """Attention over a sequence sharded across the ranks of ``group`` (default: the world): this rank's
    output shard of ``softmax(q k^T * scale) v`` over the *whole* sequence.

    Args:
        q: ``[batch, heads_q, seq_local, head_dim]``; k, v: ``[batch, heads_kv, seq_local, head_dim]``: this
            rank's shard as :func:`llm_speed.distributed.shard_sequence` cuts it (the same ``layout``).
            heads_q a multiple of heads_kv (MHA, GQA, MQA); dtypes float16, bfloat16, float32; head_dim and
            strides as :func:`llm_speed.flash_attention` accepts.
        group: a ``torch.distributed`` process group; it must be initialised (ValueError otherwise).
        is_causal: causal over global positions. Blocks wholly in the future are skipped, the diagonal block
            is causal, past blocks are full.
        scale: default ``1 / sqrt(head_dim)``; must be the same on every rank.
        layout: "zigzag" (2W chunks, rank r holds chunks r and 2W-1-r: equal causal work on every rank) or
            "contiguous" (rank r holds chunk r of W).
        return_lse: also return this shard's log-sum-exp rows ``[batch, heads_q, seq_local]`` float32.

    Sequence length: any S with at least one token per chunk (S >= 2W zigzag, S >= W contiguous); chunk
    lengths follow ``torch.tensor_split`` (the first ``S mod chunks`` chunks one token longer).

    Before any data moves, every rank all-gathers its shapes, dtype, flags and scale; when they disagree, a
    shard length is not what ``layout`` gives, or any rank's own checks failed, every rank raises ValueError
    (or the failing rank its TypeError), so a bad call never leaves a rank waiting.

    Communication per rank, forward: W-1 sends of its current K/V block (2 * batch * heads_kv * seq_local *
    head_dim elements of the input dtype); backward: W-1 such K/V sends plus W sends of the float32 dK/dV
    accumulators. Each transfer is started before the block's flash kernel and waited on after it.
    Gradients (autograd, including through the returned LSE) match the single-device flash_attention.
    """
    group, rank, world = _layout.resolve_group(group)
    error, values = None, None
    try:
        q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
        causal = check_flag("is_causal", is_causal)
        return_lse = check_flag("return_lse", return_lse)
        layout = _layout.check_layout(layout)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"q ({q.shape[2]}) and k/v ({k.shape[2]}) must hold the same tokens: ring attention is "
                "self-attention over one sharded sequence"
            )
        batch, heads_q, seq, head_dim = q.shape
        values = [
            batch, heads_q, k.shape[1], seq, head_dim, _DTYPE_CODES.index(q.dtype), causal,
            _layout.LAYOUTS.index(layout), scale, q.device.type == "cuda",
        ]  # fmt: skip
    except (TypeError, ValueError) as caught:
        error = caught
    table = _layout.agree(group, world, rank, values, error, 10)
    shared = torch.cat([table[:, :3], table[:, 4:]], dim=1)
    for r in range(1, world):  # every rank compares with rank 0, so all raise the same error
        if not torch.equal(shared[r], shared[0]):
            raise ValueError(
                f"ring_attention: rank {r}'s call differs from rank 0's in batch, heads, head_dim, "
                "dtype, is_causal, layout, scale or device type; every rank must pass its shard of the same "
                "problem"
            )
    shard_lengths = [int(n) for n in table[:, 3]]
    total = sum(shard_lengths)
    expected = _layout.shard_lengths(total, world, layout)
    if shard_lengths != expected:
        raise ValueError(
            f"ring_attention: the ranks hold {shard_lengths} tokens, which is not how layout {layout!r} "
            f"splits {total} tokens over {world} ranks ({expected}); cut the sequence with shard_sequence"
        )
    if q.shape[0] == 0:  # empty batch on every rank (the ranks agree on it): nothing to compute or send
        return _flash.flash_attention(q, k, v, is_causal=causal, scale=scale, return_lse=return_lse)
    plan = _Plan(
        group=group,
        rank=rank,
        world=world,
        layout=layout,
        is_causal=causal,
        scale=scale,
        shard_lengths=tuple(shard_lengths),
        chunk_lengths=tuple(_layout.chunk_lengths(total, world, layout)),
    )
    out, lse = _RingAttention.apply(q, k, v, plan)
    return (out, lse) if return_lse else out
