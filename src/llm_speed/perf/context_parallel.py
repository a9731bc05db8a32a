"""Context parallelism (ring attention) priced step by step, as ``llm_speed.distributed.ring_attention`` runs.

Each of the W ranks holds seq_len/W tokens. Forward: W-1 steps, each sending this rank's current K/V block to
the next rank (``2 * Hkv * d`` elements per token) while the flash kernel works on the block it holds; the
total is :func:`llm_speed.perf.distributed.context_parallel_kv_bytes_per_layer`. Backward: W-1 K/V sends plus
W sends of the float32 dK/dV accumulators that travel with them. A transfer hides under the compute when it
takes no longer than the block's kernel (Liu et al., "Ring Attention with Blockwise Transformers",
arXiv:2310.01889, derive the smallest block size for which compute covers communication).

Compute per step is the busiest rank's: a full ``s/W x s/W`` block when not causal; causal with the zigzag
layout half of one (each rank meets either the past half of a K/V shard or the future half of its queries;
zhuzilin/ring-flash-attention); causal contiguous a full block on the ranks after the sender (earlier ranks
skip it, which is the imbalance zigzag removes). Times are roofline floors (:mod:`llm_speed.perf.roofline`)
of the matmuls llm-speed's kernels execute (:func:`kernel_costs.attention_hardware_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import check_flag, non_negative_number, positive_int
from llm_speed.core.gpus import dtype_bytes, get_gpu, normalize_dtype
from llm_speed.core.sequence_split import check_layout, sequence_chunk_lengths, shard_lengths
from llm_speed.perf.distributed import link_bandwidth
from llm_speed.perf.kernel_costs import attention_cost, attention_hardware_flops
from llm_speed.perf.models import ModelConfig, resolve_model
from llm_speed.perf.roofline import roofline

GRAD_ACCUMULATOR_BYTES = 4  # dK/dV travel the ring as float32 sums


def ring_bytes_per_rank(
    *, batch: int, heads_kv: int, seq_len: int, head_dim: int, world: int, layout: str, dtype: Any
) -> list[dict[str, list[int]]]:
    """Bytes each rank sends at each step, exactly as ``ring_attention`` sends them (for uneven shards too):
    one dict per rank with lists "forward_kv" (W-1 entries), "backward_kv" (W-1) and "backward_dkv" (W).
    At step t rank r holds (and sends) the block of rank (r - t) mod W."""
    lengths = shard_lengths(seq_len, world, layout)
    per_token = 2 * positive_int("batch", batch) * positive_int("heads_kv", heads_kv)
    per_token *= positive_int("head_dim", head_dim)
    element = int(dtype_bytes(dtype))
    plans = []
    for r in range(world):
        held = [lengths[(r - t) % world] for t in range(world)]
        kv = [per_token * n * element for n in held[: world - 1]]
        plans.append(
            {
                "forward_kv": kv,
                "backward_kv": list(kv),
                "backward_dkv": [per_token * n * GRAD_ACCUMULATOR_BYTES for n in held] if world > 1 else [],
            }
        )
    return plans


@dataclass(frozen=True)
class RingAttentionPlan:
    """One attention layer of ring attention on ``cp`` GPUs, per rank (the busiest one for compute)."""

    model: str
    gpu: str
    link: str
    dtype: str
    seq_len: int
    cp: int
    micro_batch_size: int
    layout: str
    causal: bool
    tokens_per_rank: int  # the longest shard
    forward_steps: int  # transfers in forward: cp - 1
    kv_bytes_per_step: float  # one K/V shard
    dkv_bytes_per_step: float  # its float32 dK/dV accumulators (backward)
    forward_bytes_per_layer: float
    backward_bytes_per_layer: float
    link_bytes_per_s: float  # one direction
    latency_s: float  # per transfer, added to each step's transfer time
    forward_transfer_s: float  # one step: latency + K/V over the link
    backward_transfer_s: float  # one step: latency + K/V and dK/dV over the link
    forward_block_flops: float  # executed matmul FLOPs of one step's block
    backward_block_flops: float
    forward_block_s: float  # roofline floor of one step's block
    backward_block_s: float
    forward_hidden: bool  # transfer <= compute
    backward_hidden: bool
    num_layers: int

    @property
    def forward_bytes_per_rank(self) -> float:
        """Whole model, one micro-batch, forward."""
        return self.forward_bytes_per_layer * self.num_layers

    @property
    def backward_bytes_per_rank(self) -> float:
        return self.backward_bytes_per_layer * self.num_layers


def _block_shape(seq_len: int, world: int, layout: str, causal: bool) -> tuple[int, int, bool]:
    """(query rows, key columns, causal mask) of the busiest rank's block at one off-diagonal step, over
    every (receiver, sender) pair, so uneven shards count the longest chunks they meet: causal zigzag,
    rank r meets an earlier rank's first chunk with all its queries and a later rank's whole shard with its
    own later chunk; causal contiguous, only earlier ranks' shards, whole; not causal, every shard whole."""
    lengths = shard_lengths(seq_len, world, layout)
    if world == 1:  # no off-diagonal step: the rank's own block, masked where causal
        return lengths[0], lengths[0], causal
    chunks = sequence_chunk_lengths(seq_len, world, layout)
    blocks = []
    for r in range(world):
        for s in range(world):
            if s == r or (causal and layout == "contiguous" and s > r):
                continue
            if causal and layout == "zigzag":
                blocks.append((lengths[r], chunks[s]) if s < r else (chunks[2 * world - 1 - r], lengths[s]))
            else:
                blocks.append((lengths[r], lengths[s]))
    rows, cols = max(blocks, key=lambda block: block[0] * block[1])
    return rows, cols, False


def ring_attention_plan(
    model: ModelConfig | str,
    *,
    seq_len: int,
    cp: int,
    gpu: str,
    link: str = "nvlink",
    micro_batch_size: int = 1,
    dtype: Any = "bf16",
    layout: str = "zigzag",
    causal: bool = True,
    latency_s: float = 0.0,
) -> RingAttentionPlan:
    """Bytes per rank per step, compute per block and whether the transfer hides, for ``model`` on ``cp``
    GPUs of type ``gpu`` linked by ``link`` ("nvlink" or "pcie"). MHA/GQA/MQA models (llm-speed's flash
    kernel needs one head_dim for Q, K and V, so MLA is refused)."""
    config = resolve_model(model)
    if config.uses_mla:
        raise ValueError(
            f"{config.name} uses MLA (query/key and value head dims differ); ring_attention runs llm-speed's "
            "flash kernel, which needs one head_dim: choose an MHA/GQA/MQA model"
        )
    c = positive_int("cp", cp)
    b = positive_int("micro_batch_size", micro_batch_size)
    layout = check_layout(layout)
    dtype_name = normalize_dtype(dtype)
    latency = non_negative_number("latency_s", latency_s)
    spec = get_gpu(gpu)
    bandwidth = link_bandwidth(spec, link)
    causal = check_flag("causal", causal)
    sends = ring_bytes_per_rank(
        batch=b,
        heads_kv=config.num_kv_heads,
        seq_len=seq_len,
        head_dim=config.head_dim,
        world=c,
        layout=layout,
        dtype=dtype_name,
    )
    tokens = max(shard_lengths(seq_len, c, layout))
    per_token = 2 * b * config.num_kv_heads * config.head_dim
    kv_step = float(per_token * tokens * dtype_bytes(dtype_name))
    dkv_step = float(per_token * tokens * GRAD_ACCUMULATOR_BYTES) if c > 1 else 0.0
    forward_total = max(sum(s["forward_kv"]) for s in sends)
    backward_total = max(sum(s["backward_kv"]) + sum(s["backward_dkv"]) for s in sends)

    rows, cols, masked = _block_shape(seq_len, c, layout, causal)
    shape = (b, config.num_attention_heads, rows, max(cols, 1), config.head_dim)
    timed = {}
    for mode in ("fwd", "bwd"):
        flops = attention_hardware_flops(*shape, causal=masked, mode=mode, gpu=spec)
        moved = attention_cost(
            *shape, heads_kv=config.num_kv_heads, dtype=dtype_name, causal=masked, mode=mode
        ).bytes_moved
        timed[mode] = (flops, roofline(flops, moved, dtype_name, spec).time_floor_s)
    forward_transfer = latency + kv_step / bandwidth if c > 1 else 0.0
    backward_transfer = latency + (kv_step + dkv_step) / bandwidth if c > 1 else 0.0
    return RingAttentionPlan(
        model=config.name,
        gpu=spec.id,
        link=link,
        dtype=dtype_name,
        seq_len=seq_len,
        cp=c,
        micro_batch_size=b,
        layout=layout,
        causal=causal,
        tokens_per_rank=tokens,
        forward_steps=c - 1,
        kv_bytes_per_step=kv_step if c > 1 else 0.0,
        dkv_bytes_per_step=dkv_step,
        forward_bytes_per_layer=float(forward_total),
        backward_bytes_per_layer=float(backward_total),
        link_bytes_per_s=bandwidth,
        latency_s=latency,
        forward_transfer_s=forward_transfer,
        backward_transfer_s=backward_transfer,
        forward_block_flops=timed["fwd"][0],
        backward_block_flops=timed["bwd"][0],
        forward_block_s=timed["fwd"][1],
        backward_block_s=timed["bwd"][1],
        forward_hidden=forward_transfer <= timed["fwd"][1],
        backward_hidden=backward_transfer <= timed["bwd"][1],
        num_layers=config.num_layers,
    )
