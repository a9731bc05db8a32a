"""Inference analysis of a model on a GPU: every op of prefill and of one decode step on the roofline.

Model (stated once):

* Each op is one kernel that reads its inputs from and writes its outputs to HBM once (no cross-op fusion
  except FlashAttention, which never writes the score matrix). Its time floor is the roofline's
  max(FLOPs / peak, bytes / bandwidth) (:func:`llm_speed.perf.roofline.roofline`); a phase's floor is the sum
  of its ops' floors. TTFT and tokens/s are therefore upper bounds on speed (lower bounds on time).
* Weights and activations are stored in ``dtype``, the KV cache in ``kv_dtype``; the GEMMs run at ``dtype``'s
  dense tensor-core peak. Weight GEMMs use :func:`llm_speed.perf.kernel_costs.gemm_cost`, attention
  :func:`llm_speed.perf.kernel_costs.attention_cost` (FlashAttention: causal halving, GQA K/V read once).
* Prefill: ``batch_size`` prompts of ``seq_len`` tokens; the LM head runs on the last token of each prompt.
* Decode: one step for ``batch_size`` sequences, each attending to a cache of ``decode_context`` tokens, the
  mean context over the ``decode_tokens`` generated (seq_len + decode_tokens // 2): attention cost is linear
  in the context, so the mean step stands for the whole generation.
* MoE: exact expert FLOPs (T*k routed tokens); expert weights read = expected distinct experts hit under
  uniform routing, E * (1 - (1 - k/E)^T), per layer (all experts once T*k >> E).
* MLA (DeepSeek): prefill runs the up-projected ("naive") attention; decode the weight-absorbed form that
  attends over the cached latent (kv_lora_rank + rope dims shared by all heads, read once).
* Elementwise FLOP counts (norms 4/element, RoPE 3, SwiGLU 5, softmax 5) are approximate; those ops are
  memory-bound by orders of magnitude, so their bytes set their time.

Seed 003's prefill/decode example (batch 1, L=2048, d=4096): prefill GEMMs have intensity ~ L when the
weights dominate the traffic, decode GEMMs ~1 (a GEMV) — which is why batching decode matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_speed.perf._checks import positive_int
from llm_speed.perf.gpus import GPUSpec, dtype_bytes, get_gpu, normalize_dtype
from llm_speed.perf.kernel_costs import (
    SOFTMAX_STATS_BYTES,
    KernelCost,
    attention_cost,
    gemm_cost,
    visible_pairs,
)
from llm_speed.perf.kv_cache import kv_cache_size
from llm_speed.perf.models import ModelConfig, gemm_shapes, param_count, resolve_model
from llm_speed.perf.roofline import roofline
from llm_speed.perf.training import attention_pairs

PHASES = ("prefill", "decode")
NORM_FLOPS_PER_ELEMENT = 4  # square, accumulate, scale by rsqrt, scale by weight
ROPE_FLOPS_PER_ELEMENT = 3  # a 2x2 rotation: 4 multiplies + 2 adds per pair of elements
SWIGLU_FLOPS_PER_ELEMENT = 5  # silu(x) = x * sigmoid(x) (~4) times up (1)
SOFTMAX_FLOPS_PER_ELEMENT = 5  # max, subtract, exp, sum, divide
DEFAULT_BATCH_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class InferenceOp:
    """One op summed over the ``count`` layers (or experts x layers) it runs in."""

    name: str
    phase: str
    count: int
    flops: float
    bytes_moved: float
    intensity: float
    bound: str
    time_floor_s: float


@dataclass(frozen=True)
class PhaseTotals:
    """Sums over a phase's ops. ``time_floor_s`` adds the ops' floors; ``bound`` says which resource most of
    that time is spent on (compute-bound ops' time vs memory-bound ops' time)."""

    flops: float
    bytes_moved: float
    intensity: float
    time_floor_s: float
    compute_bound_time_s: float
    memory_bound_time_s: float
    bound: str


@dataclass(frozen=True)
class InferenceAnalysis:
    """Prefill and decode of ``model`` on ``gpu``: per-op rows, totals, and speed bounds."""

    model: str
    gpu: str
    dtype: str
    kv_dtype: str
    batch_size: int
    seq_len: int
    decode_tokens: int
    decode_context: int
    ops: tuple[InferenceOp, ...]
    prefill: PhaseTotals
    decode: PhaseTotals
    ttft_s: float  # prefill time floor (the first token comes out of prefill)
    decode_step_s: float  # one step for the whole batch
    time_per_output_token_s: float  # per sequence: = decode_step_s
    decode_tokens_per_s: float  # whole batch: batch_size / decode_step_s
    total_time_s: float  # ttft + decode_tokens * decode_step_s
    weights_bytes: float
    kv_cache_bytes: float  # at seq_len + decode_tokens
    memory_required_bytes: float  # weights + final KV cache (activations are comparatively small)
    gpu_memory_bytes: float
    fits_in_memory: bool
    max_position_embeddings: int  # the model's trained context length
    exceeds_max_position: bool  # seq_len + decode_tokens > max_position_embeddings (costs still computed)


def expected_experts_hit(num_experts: int, experts_per_token: int, num_tokens: float) -> float:
    """E * (1 - (1 - k/E)^T): expected number of distinct experts that T tokens choosing k of E experts
    uniformly at random touch (each expert is missed by one token with probability 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)


def generalized_attention_cost(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    qk_dim: int,
    v_dim: int,
    *,
    heads_kv: int,
    kv_bytes_per_token: float | None = None,
    dtype: Any = "bf16",
    causal: bool,
    sliding_window: int | None = None,
) -> KernelCost:
    """FlashAttention forward with separate query/key and value widths and an optional sliding window.

    FLOPs = 2 * B * Hq * pairs * (d_qk + d_v) (QK^T and PV). pairs: causal without a window per
    :func:`kernel_costs.visible_pairs` (bottom-right aligned); causal square with window w per
    :func:`training.attention_pairs`; non-causal seq_q * min(seq_kv, w). Bytes = e*B*Hq*seq_q*(d_qk + d_v)
    (read Q, write O) + the K/V read, B * n_kv * kv_bytes_per_token (default e*Hkv*(d_qk + d_v) per token),
    where n_kv = min(seq_kv, w + seq_q - 1) keys are visible to some query, + fp32 LSE 4 * B * Hq * seq_q.
    With d_qk = d_v and no window it equals :func:`kernel_costs.attention_cost` (tested).
    """
    element = dtype_bytes(dtype)
    if sliding_window is None:
        kv_read = seq_kv
        pairs = visible_pairs(seq_q, seq_kv, causal)
    elif not causal:
        kv_read = min(seq_kv, sliding_window + seq_q - 1)
        pairs = seq_q * min(seq_kv, sliding_window)
    elif seq_q == seq_kv:
        kv_read = seq_kv
        pairs = attention_pairs(seq_q, causal=True, sliding_window=sliding_window)
    else:
        raise ValueError("causal sliding-window attention needs seq_q == seq_kv (prefill) or causal=False")
    flops = 2.0 * batch * heads_q * pairs * (qk_dim + v_dim)
    per_token = element * heads_kv * (qk_dim + v_dim) if kv_bytes_per_token is None else kv_bytes_per_token
    bytes_moved = (
        element * batch * heads_q * seq_q * (qk_dim + v_dim)
        + batch * kv_read * per_token
        + SOFTMAX_STATS_BYTES * batch * heads_q * seq_q
    )
    return KernelCost(flops, float(bytes_moved))


class _OpBuilder:
    """Collects ops of one phase and places each on the roofline."""

    def __init__(self, phase: str, gpu: GPUSpec, dtype: str) -> None:
        self.phase, self.gpu, self.dtype = phase, gpu, dtype
        self.ops: list[InferenceOp] = []

    def add(self, name: str, cost: KernelCost, count: int) -> None:
        flops, bytes_moved = cost.flops * count, cost.bytes_moved * count
        point = roofline(flops, bytes_moved, self.dtype, self.gpu)
        self.ops.append(
            InferenceOp(
                name, self.phase, count, flops, bytes_moved, point.intensity, point.bound, point.time_floor_s
            )
        )


def _phase_ops(
    config: ModelConfig,
    gpu: GPUSpec,
    dtype: str,
    kv_dtype: str,
    *,
    phase: str,
    batch: int,
    new_tokens: int,
    context: int,
) -> list[InferenceOp]:
    """Ops of one forward pass: ``batch`` sequences, ``new_tokens`` each, attending to ``context`` keys."""
    builder = _OpBuilder(phase, gpu, dtype)
    e = dtype_bytes(dtype)
    h, layers = config.hidden_size, config.num_layers
    heads, kv_heads = config.num_attention_heads, config.num_kv_heads
    tokens = batch * new_tokens

    def elementwise(read: float, write: float, flops: float) -> KernelCost:
        return KernelCost(flops, (read + write) * e)

    builder.add("embedding", elementwise(tokens * h, tokens * h, 0.0), 1)
    norm = KernelCost(NORM_FLOPS_PER_ELEMENT * tokens * h, (2 * tokens * h + h) * e)
    builder.add("rmsnorm", norm, 2 * layers + 1)
    if config.uses_mla:  # MLA normalises its query and KV latents too
        latent = config.q_lora_rank + config.kv_lora_rank
        latent_norm = KernelCost(NORM_FLOPS_PER_ELEMENT * tokens * latent, (2 * tokens * latent + latent) * e)
        builder.add("latent_rmsnorm", latent_norm, layers)

    # Weight GEMMs of the attention block and dense MLPs, from the model's GEMM list.
    moe_gemms = ("router", "expert_gate_up", "expert_up", "expert_down")
    for shape in gemm_shapes(config, tokens, lm_head_tokens=batch):
        if shape.name in moe_gemms:
            continue
        builder.add(shape.name, gemm_cost(shape.m, shape.n, shape.k, dtype=dtype), shape.count)

    rotated_heads = heads + (1 if config.uses_mla else kv_heads)
    rope_elements = tokens * rotated_heads * config.rope_dim
    rope_table = new_tokens * config.rope_dim  # cos and sin, rope_dim/2 each, for the new positions
    builder.add(
        "rope",
        elementwise(rope_elements + rope_table, rope_elements, ROPE_FLOPS_PER_ELEMENT * rope_elements),
        layers,
    )

    kv_per_token = kv_cache_size(config, seq_len=1, dtype=kv_dtype).bytes_per_token_per_layer
    causal = phase == "prefill"
    if config.uses_mla and phase == "decode":
        # Absorbed MLA: every head attends over the shared latent (kv_lora_rank) + rope key; values are the
        # latent. The cache is read once for all heads.
        attention = generalized_attention_cost(
            batch,
            heads,
            new_tokens,
            context,
            config.kv_lora_rank + config.qk_rope_head_dim,
            config.kv_lora_rank,
            heads_kv=1,
            kv_bytes_per_token=kv_per_token,
            dtype=dtype,
            causal=False,
        )
    elif config.uses_mla or config.sliding_window or kv_dtype != dtype:
        kv_bytes = None if config.uses_mla else kv_per_token
        attention = generalized_attention_cost(
            batch,
            heads,
            new_tokens,
            context,
            config.qk_head_dim,
            config.value_head_dim,
            heads_kv=kv_heads,
            kv_bytes_per_token=kv_bytes,
            dtype=dtype,
            causal=causal,
            sliding_window=config.sliding_window,
        )
    else:
        attention = attention_cost(
            batch, heads, new_tokens, context, config.head_dim, heads_kv=kv_heads, dtype=dtype, causal=causal
        )
    builder.add("attention", attention, layers)

    residual = elementwise(2 * tokens * h, tokens * h, tokens * h)
    builder.add("residual_add", residual, 2 * layers)

    up_width = config.intermediate_size
    if config.num_dense_layers:
        builder.add("mlp_activation", _activation(config, tokens, up_width, e), config.num_dense_layers)
    if config.is_moe:
        _moe_ops(builder, config, tokens, e)
    return builder.ops


def _activation(config: ModelConfig, tokens: float, width: int, element_bytes: float) -> KernelCost:
    """The MLP activation as its own kernel: SwiGLU reads gate and up (2*T*I) and writes T*I, a plain
    activation reads T*I and writes T*I; ~5 FLOPs per output element."""
    reads = (2 if config.gated_mlp else 1) * tokens * width
    return KernelCost(SWIGLU_FLOPS_PER_ELEMENT * tokens * width, (reads + tokens * width) * element_bytes)


def _moe_ops(builder: _OpBuilder, config: ModelConfig, tokens: int, e: float) -> None:
    """Router GEMM, top-k selection, dispatch, routed experts, their activation, and the weighted combine."""
    h, experts, k = config.hidden_size, config.num_experts, config.experts_per_token
    moe_layers, width = config.num_moe_layers, config.moe_intermediate_size
    routed = tokens * k
    builder.add("router", gemm_cost(tokens, experts, h, dtype=builder.dtype), moe_layers)
    # Top-k over fp32 scores: read T*E scores, write k (index int32, weight fp32) per token.
    topk = KernelCost(SOFTMAX_FLOPS_PER_ELEMENT * tokens * experts, 4.0 * tokens * experts + 8.0 * routed)
    builder.add("router_topk", topk, moe_layers)
    builder.add("moe_dispatch", KernelCost(0.0, (tokens * h + routed * h) * e), moe_layers)
    up = (2 if config.gated_mlp else 1) * width
    hit = expected_experts_hit(experts, k, tokens)
    gemm_bytes_up = (hit * h * up + routed * (h + up)) * e
    gemm_bytes_down = (hit * width * h + routed * (width + h)) * e
    builder.add(
        "expert_gate_up" if config.gated_mlp else "expert_up",
        KernelCost(2.0 * routed * h * up, gemm_bytes_up),
        moe_layers,
    )
    builder.add("expert_activation", _activation(config, routed, width, e), moe_layers)
    builder.add("expert_down", KernelCost(2.0 * routed * width * h, gemm_bytes_down), moe_layers)
    if config.num_shared_experts:
        shared = _activation(config, tokens, width * config.num_shared_experts, e)
        builder.add("shared_expert_activation", shared, moe_layers)
    builder.add("moe_combine", KernelCost(2.0 * routed * h, (routed * h + tokens * h) * e), moe_layers)


def _totals(ops: list[InferenceOp]) -> PhaseTotals:
    flops = sum(op.flops for op in ops)
    bytes_moved = sum(op.bytes_moved for op in ops)
    compute_time = sum(op.time_floor_s for op in ops if op.bound == "compute")
    memory_time = sum(op.time_floor_s for op in ops if op.bound == "memory")
    return PhaseTotals(
        flops,
        bytes_moved,
        flops / bytes_moved,
        compute_time + memory_time,
        compute_time,
        memory_time,
        "compute" if compute_time > memory_time else "memory",
    )


def weights_bytes(config: ModelConfig, dtype: str) -> float:
    """Bytes of all weights stored in ``dtype``: param_count(config).total * bytes(dtype)."""
    return param_count(config).total * dtype_bytes(dtype)


def analyze_inference(
    model: ModelConfig | str,
    gpu: GPUSpec | str,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    decode_tokens: int = 256,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
) -> InferenceAnalysis:
    """Per-op FLOPs, bytes, intensity, bound and time floor of prefill and of one decode step, with totals,
    TTFT and decode tokens/s upper bounds and the memory needed (see the module docstring for the model).

    ``model``: ModelConfig, zoo id or config.json path; ``gpu``: GPUSpec or id; ``dtype``: weights,
    activations and compute; ``kv_dtype``: the KV cache (default ``dtype``; e.g. "fp8" or "int4").
    """
    config = resolve_model(model)
    spec = get_gpu(gpu)
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    positive_int("decode_tokens", decode_tokens)
    dtype_name = normalize_dtype(dtype)
    kv_name = dtype_name if kv_dtype is None else normalize_dtype(kv_dtype)
    spec.peak_flops(dtype_name)  # a dtype this GPU has no peak for fails here, naming the accepted ones
    decode_context = seq_len + decode_tokens // 2
    prefill_ops = _phase_ops(
        config,
        spec,
        dtype_name,
        kv_name,
        phase="prefill",
        batch=batch_size,
        new_tokens=seq_len,
        context=seq_len,
    )
    decode_ops = _phase_ops(
        config,
        spec,
        dtype_name,
        kv_name,
        phase="decode",
        batch=batch_size,
        new_tokens=1,
        context=decode_context,
    )
    prefill, decode = _totals(prefill_ops), _totals(decode_ops)
    weights = weights_bytes(config, dtype_name)
    kv_bytes = kv_cache_size(
        config, seq_len=seq_len + decode_tokens, batch_size=batch_size, dtype=kv_name
    ).total_bytes
    required = weights + kv_bytes
    return InferenceAnalysis(
        model=config.name,
        gpu=spec.id,
        dtype=dtype_name,
        kv_dtype=kv_name,
        batch_size=batch_size,
        seq_len=seq_len,
        decode_tokens=decode_tokens,
        decode_context=decode_context,
        ops=tuple(prefill_ops + decode_ops),
        prefill=prefill,
        decode=decode,
        ttft_s=prefill.time_floor_s,
        decode_step_s=decode.time_floor_s,
        time_per_output_token_s=decode.time_floor_s,
        decode_tokens_per_s=batch_size / decode.time_floor_s,
        total_time_s=prefill.time_floor_s + decode_tokens * decode.time_floor_s,
        weights_bytes=weights,
        kv_cache_bytes=kv_bytes,
        memory_required_bytes=required,
        gpu_memory_bytes=spec.memory_capacity_bytes,
        fits_in_memory=required <= spec.memory_capacity_bytes,
        max_position_embeddings=config.max_position_embeddings,
        exceeds_max_position=seq_len + decode_tokens > config.max_position_embeddings,
    )


@dataclass(frozen=True)
class DecodeSweepRow:
    """One decode step at ``batch_size``: totals, speed bounds, and the KV cache + weights it needs."""

    batch_size: int
    flops: float
    bytes_moved: float
    intensity: float
    bound: str
    step_time_s: float
    tokens_per_s: float
    gemm_intensity: float  # FLOP/byte of the weight GEMMs alone (~ batch size for 16-bit weights)
    memory_required_bytes: float
    fits_in_memory: bool


def decode_batch_sweep(
    model: ModelConfig | str,
    gpu: GPUSpec | str,
    *,
    seq_len: int = 2048,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SWEEP,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
) -> list[DecodeSweepRow]:
    """How batch size moves one decode step (context ``seq_len``) from memory- to compute-bound.

    Weight GEMMs read their weights once per step whatever the batch, so their intensity grows ~ batch
    (2*B*n*k FLOPs over ~n*k*e bytes) until it crosses the GPU's ridge point; attention over each sequence's
    own KV cache stays at ~1-2 FLOP/byte x (heads per KV head) at any batch, which caps the gain.
    """
    config = resolve_model(model)
    spec = get_gpu(gpu)
    positive_int("seq_len", seq_len)
    if not batch_sizes:
        raise ValueError("batch_sizes must not be empty")
    dtype_name = normalize_dtype(dtype)
    kv_name = dtype_name if kv_dtype is None else normalize_dtype(kv_dtype)
    spec.peak_flops(dtype_name)
    weights = weights_bytes(config, dtype_name)
    gemm_names = {shape.name for shape in gemm_shapes(config, 1)} | {
        "expert_gate_up",
        "expert_up",
        "expert_down",
    }
    rows = []
    for batch in batch_sizes:
        positive_int("batch_sizes entry", batch)
        ops = _phase_ops(
            config, spec, dtype_name, kv_name, phase="decode", batch=batch, new_tokens=1, context=seq_len
        )
        totals = _totals(ops)
        gemm_flops = sum(op.flops for op in ops if op.name in gemm_names)
        gemm_bytes = sum(op.bytes_moved for op in ops if op.name in gemm_names)
        required = (
            weights + kv_cache_size(config, seq_len=seq_len, batch_size=batch, dtype=kv_name).total_bytes
        )
        rows.append(
            DecodeSweepRow(
                batch_size=batch,
                flops=totals.flops,
                bytes_moved=totals.bytes_moved,
                intensity=totals.intensity,
                bound=totals.bound,
                step_time_s=totals.time_floor_s,
                tokens_per_s=batch / totals.time_floor_s,
                gemm_intensity=gemm_flops / gemm_bytes,
                memory_required_bytes=required,
                fits_in_memory=required <= spec.memory_capacity_bytes,
            )
        )
    return rows
