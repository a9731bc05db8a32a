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

* Weight-only quantization: weights stored in ``weight_dtype`` (int8, int4, fp8) with one ``scale_bytes``
  scale per ``weight_group_size`` elements are read at those bytes; the GEMMs still compute in ``dtype``.
  Their realistic times add the dequantization as :mod:`llm_speed.perf.predict` models it (the vendor's
  GEMMs: one conversion per weight on the CUDA cores, partly overlapped with the weight stream), the
  floors do not.
  The embedding table stays in ``dtype`` (gpt-fast and most weight-only schemes quantize linear layers only).
* Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3): every GPU holds 1/tp of the heads, the
  MLP width and the vocabulary (KV heads replicated when there are fewer than tp); each layer ends its
  attention and its MLP with an all-reduce of the layer's activations (2 per layer), and the logits are
  all-gathered once. Ops are per GPU; the GPUs of a TP group run in lock step.
* Pipeline parallelism: each of the pp stages holds ceil(layers/pp) layers; a token still passes every
  stage in turn, so a step's time is the sum of the stages plus pp-1 point-to-point activation sends
  (latency view: no micro-batch overlap between stages). pp divides the memory, not the step time.
* Floors use the datasheet peaks and line rates; realistic times use :class:`~llm_speed.perf.efficiency.
  Efficiency` (compute, memory, collective efficiency and latency) and predict's dequantization model.

At batch 1 and a short context, prefill GEMMs have intensity ~ L when the weights dominate the traffic,
decode GEMMs ~1 (a GEMV): which is why batching decode matters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.core.gpus import GPUSpec, dtype_bytes, get_gpu, normalize_dtype
from llm_speed.perf.distributed import link_bandwidth
from llm_speed.perf.efficiency import FLOOR, Efficiency, all_reduce_time, realistic_time
from llm_speed.perf.kernel_costs import (
    SOFTMAX_STATS_BYTES,
    KernelCost,
    attention_cost,
    expected_experts_hit,
    gemm_cost,
    visible_pairs,
)
from llm_speed.perf.kv_cache import kv_cache_size
from llm_speed.perf.models import ModelConfig, gemm_shapes, param_count, resolve_model
from llm_speed.perf.predict import Prediction, dequant_model, predict, predict_work, with_dequant
from llm_speed.perf.prediction.names import gemm_op_for
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
    realistic_time_s: float  # with the analysis' Efficiency (compute, memory) and predict's dequantization
    predicted_time_s: float = 0.0  # calibrated prediction (llm_speed.perf.predict), summed over ``count``
    predicted_bound: str = ""  # compute, memory or latency (per call)


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
    realistic_time_s: float = 0.0  # sum of the ops' realistic times (collectives not included)
    predicted_time_s: float = 0.0  # sum of the ops' calibrated predictions (collectives not included)
    bounding_op: str = ""  # the op with the largest predicted time
    bounding_op_bound: str = ""  # what bounds that op: compute, memory or latency
    bounding_op_share: float = 0.0  # its share of the phase's predicted time


@dataclass(frozen=True)
class Communication:
    """Collectives of one forward pass per GPU: TP all-reduces and logits all-gather, PP sends."""

    all_reduces: int
    all_reduce_bytes: float  # each
    logits_all_gather_bytes: float
    pipeline_sends: int
    pipeline_send_bytes: float  # each
    floor_s: float  # line rate, no latency
    realistic_s: float  # Efficiency.collective / nvls and collective_latency_s


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
    weights_bytes: float  # all GPUs together
    kv_cache_bytes: float  # at seq_len + decode_tokens, all GPUs together
    memory_required_bytes: float  # weights + final KV cache (activations are comparatively small)
    gpu_memory_bytes: float
    fits_in_memory: bool  # the busiest GPU's share fits in its memory
    max_position_embeddings: int  # the model's trained context length
    exceeds_max_position: bool  # seq_len + decode_tokens > max_position_embeddings (costs still computed)
    weight_dtype: str = ""
    weight_bytes_per_element: float = 0.0  # storage incl. group scales
    tp: int = 1
    pp: int = 1
    collective_algorithm: str = "ring"
    efficiency_source: str = ""
    weights_bytes_per_gpu: float = 0.0  # the heaviest pipeline stage's TP shard
    kv_cache_bytes_per_gpu: float = 0.0
    memory_per_gpu_bytes: float = 0.0
    prefill_communication: Communication | None = None
    decode_communication: Communication | None = None
    ttft_realistic_s: float = 0.0
    decode_step_realistic_s: float = 0.0
    decode_tokens_per_s_realistic: float = 0.0
    total_time_realistic_s: float = 0.0
    implementation: str = ""  # whose kernels the predictions are of ("" when not predicted)
    prediction_context: str = ""
    prediction_calibrated: bool = False  # the GPU has calibration measurements of its own
    prediction_source: str = ""
    ttft_predicted_s: float = 0.0
    decode_step_predicted_s: float = 0.0
    decode_tokens_per_s_predicted: float = 0.0
    total_time_predicted_s: float = 0.0
    prefill_mfu_predicted: float = 0.0  # prefill FLOPs / predicted TTFT / dense peak
    decode_mfu_predicted: float = 0.0


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


@dataclass(frozen=True)
class WeightStorage:
    """How weights are stored: ``dtype`` plus one ``scale_bytes`` scale per ``group_size`` elements (None:
    per output channel, negligible). ``bytes_per_element`` includes the scales."""

    dtype: str
    group_size: int | None
    scale_bytes: float
    bytes_per_element: float


def weight_storage(
    weight_dtype: Any, compute_dtype: str, *, group_size: int | None = None, scale_bytes: float = 2.0
) -> WeightStorage:
    """Checked :class:`WeightStorage`; weights in the compute dtype carry no scales. int4 with group 32 and an
    fp16 scale + zero point (gpt-fast's int4, ``scale_bytes=4``): 0.5 + 4/32 = 0.625 bytes per weight."""
    name = compute_dtype if weight_dtype is None else normalize_dtype(weight_dtype)
    if name not in ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"):
        raise ValueError(
            f"weight_dtype {weight_dtype!r} is not a storage dtype; accepted: bf16, fp16, fp32, "
            "fp8, int8, int4, fp4"
        )
    scales = non_negative_number("weight_scale_bytes", scale_bytes)
    group = None if group_size is None else positive_int("weight_group_size", group_size)
    per_element = dtype_bytes(name)
    if name != compute_dtype and group is not None:
        per_element += scales / group
    return WeightStorage(name, group, scales, per_element)


def tp_shard(config: ModelConfig, tp: int) -> ModelConfig:
    """The part of ``config`` one GPU of a ``tp``-way tensor-parallel group holds (Megatron-LM sharding):
    query heads, MLP and expert widths and the vocabulary divided by tp; KV heads divided by tp, or one
    replicated KV head per GPU when tp exceeds them. Raises ValueError naming the valid tp."""
    tp = positive_int("tp", tp)
    if tp == 1:
        return config
    heads, kv_heads = config.num_attention_heads, config.num_kv_heads
    widths = [heads, config.intermediate_size] + ([config.moe_intermediate_size] if config.is_moe else [])
    valid = [t for t in range(1, heads + 1) if all(w % t == 0 for w in widths)]
    if tp not in valid or (kv_heads % tp and tp % kv_heads):
        raise ValueError(
            f"tp ({tp}) must divide the heads ({heads}) and MLP widths of {config.name} and divide or be a "
            f"multiple of its KV heads ({kv_heads}); valid tp: {', '.join(map(str, valid))}"
        )
    return replace(
        config,
        num_attention_heads=heads // tp,
        num_kv_heads=max(1, kv_heads // tp),
        intermediate_size=config.intermediate_size // tp,
        moe_intermediate_size=config.moe_intermediate_size // tp,
        vocab_size=math.ceil(config.vocab_size / tp),
    )


def analysed_row(op: str, dtype: str, problem: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The op-table row, and its problem with the dtype, that computes ``op`` of an analysis in ``dtype``:
    an 8-bit GEMM its own row (:func:`~llm_speed.perf.prediction.names.gemm_op_for`), fp8 prefill attention
    flash_attention_fp8, an fp8 decode step a bfloat16 query over the fp8 cache (the query is not stored);
    a dtype no row computes in is refused by predict (and the analysis prices it by FLOPs and bytes)."""
    if op == "gemm":
        return gemm_op_for(dtype), {**problem, "dtype": dtype}
    if dtype == "fp8" and op == "flash_attention":
        return "flash_attention_fp8", {**problem, "dtype": dtype}
    if dtype == "fp8" and op == "attention_kvcache_fwd":
        return op, {**problem, "dtype": "bf16", "kv_dtype": dtype}
    return op, {**problem, "dtype": dtype}


@dataclass(frozen=True)
class Predictor:
    """Calibrated predictions (:func:`llm_speed.perf.predict.predict`) of the ops of an analysis, as
    ``implementation``'s kernels run them on ``gpu`` in ``context`` ("stream": a model's kernels back to
    back; "graph": replayed from a CUDA graph, no host path)."""

    gpu: GPUSpec
    implementation: str = "llm-speed"
    context: str = "stream"
    calibration: Any = None

    def __call__(self, dtype: str, cost: KernelCost, predict_as: tuple | None) -> Prediction:
        family = "elementwise"
        if predict_as is not None:
            op, problem, family = predict_as
            if op is not None:
                op, problem = analysed_row(op, normalize_dtype(dtype), problem)
                try:
                    return predict(op, self.gpu, implementation=self.implementation, context=self.context,
                                   calibration=self.calibration, **problem)  # fmt: skip
                except ValueError:
                    pass  # not modelled for this implementation or shape: by its FLOPs and bytes
        return predict_work(
            self.gpu, flops=cost.flops, bytes_moved=cost.bytes_moved, dtype=dtype, family=family,
            implementation=self.implementation, context=self.context, calibration=self.calibration,
        )  # fmt: skip


class _OpBuilder:
    """Collects ops of one phase and places each on the roofline (and, with a predictor, predicts it)."""

    def __init__(
        self,
        phase: str,
        gpu: GPUSpec,
        dtype: str,
        weights: WeightStorage,
        efficiency: Efficiency,
        predictor: Predictor | None = None,
    ) -> None:
        self.phase, self.gpu, self.dtype = phase, gpu, dtype
        self.weights, self.efficiency = weights, efficiency
        self.predictor = predictor
        self.ops: list[InferenceOp] = []
        # Weights read quantized: the realistic estimate dequantizes them as predict models the vendor's
        # GEMMs (llm-speed has no weight-only kernel of its own; its predictions model it as cuBLAS's).
        self.calibration = None if predictor is None else predictor.calibration
        self.dequant_overlap = 1.0
        self.storage: dict[str, Any] = {}  # predict's problem arguments of the weights' storage
        if weights.dtype != dtype:
            model = dequant_model(gpu, weights.dtype, implementation="vendor", calibration=self.calibration)
            self.dequant_overlap = model["overlap"]
            self.storage = dict(weight_dtype=weights.dtype, group_size=weights.group_size,
                                scale_bytes=weights.scale_bytes)  # fmt: skip

    def add(
        self,
        name: str,
        cost: KernelCost,
        count: int,
        *,
        dequant_share: float = 0.0,
        predict_as: tuple | None = None,
    ) -> None:
        """One op run ``count`` times; ``dequant_share``: the dequantization of its weights (read quantized)
        in seconds per second of its memory time, overlapped with that time as
        :func:`llm_speed.perf.predict.with_dequant` says; ``predict_as``: (op table row or None, its problem,
        family) for the calibrated prediction (None: a kernel known by its FLOPs and bytes)."""
        flops, bytes_moved = cost.flops * count, cost.bytes_moved * count
        point = roofline(flops, bytes_moved, self.dtype, self.gpu)
        realistic = realistic_time(
            flops,
            bytes_moved,
            point.peak_flops,
            point.memory_bandwidth,
            compute=self.efficiency.compute,
            memory=self.efficiency.memory,
        )
        if dequant_share:
            stream_s = bytes_moved / (point.memory_bandwidth * self.efficiency.memory)
            memory_s = with_dequant(stream_s, dequant_share * stream_s, self.dequant_overlap)
            realistic = max(flops / (point.peak_flops * self.efficiency.compute), memory_s)
        predicted, bound = 0.0, ""
        if self.predictor is not None and count:
            prediction = self.predictor(self.dtype, cost, predict_as)
            predicted, bound = prediction.seconds * count, prediction.bound
        self.ops.append(
            InferenceOp(
                name,
                self.phase,
                count,
                flops,
                bytes_moved,
                point.intensity,
                point.bound,
                point.time_floor_s,
                realistic,
                predicted,
                bound,
            )
        )

    def weight_gemm(self, name: str, m: float, n: int, k: int, count: int) -> None:
        """out[m, n] = A[m, k] @ W[k, n]: activations in the compute dtype, W at the stored bytes. Weights
        stored in another dtype are dequantized as :func:`llm_speed.perf.predict.predict` models this GEMM
        (the conversions per weight, once per row of tiles, on the units that run them, overlapped with the
        weight stream): the realistic estimate takes predict's dequantization time as a share of predict's
        DRAM time, so that its ``memory`` efficiency slows both alike (measured end to end, e.g. gpt-fast's
        power-capped A100s, it covers clocks as well as bandwidth)."""
        e = dtype_bytes(self.dtype)
        cost = KernelCost(2.0 * m * n * k, (m * k + m * n) * e + k * n * self.weights.bytes_per_element)
        problem: dict[str, Any] = {"m": int(m), "n": int(n), "k": int(k), **self.storage}
        share = self.dequant_share(problem)
        self.add(name, cost, count, dequant_share=share, predict_as=("gemm", problem, "gemm"))

    def dequant_share(self, problem: dict[str, Any]) -> float:
        """predict's dequantization time of the GEMM ``problem`` (its weights as :attr:`storage` says) per
        second of its DRAM time; 0 for weights in the compute dtype."""
        if not self.storage:
            return 0.0
        try:
            terms = predict(gemm_op_for(normalize_dtype(self.dtype)), self.gpu, implementation="vendor",
                            context="graph", calibration=self.calibration, dtype=self.dtype,
                            **problem).breakdown  # fmt: skip
        except ValueError:
            return 0.0  # no GEMM row computes in this dtype: no dequantization modelled (by FLOPs and bytes)
        return terms.dequant_s / (terms.dram_bytes / terms.achievable_bandwidth)


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
    weights: WeightStorage | None = None,
    efficiency: Efficiency = FLOOR,
    predictor: Predictor | None = None,
) -> list[InferenceOp]:
    """Ops of one forward pass: ``batch`` sequences, ``new_tokens`` each, attending to ``context`` keys."""
    weights = weight_storage(None, dtype) if weights is None else weights
    builder = _OpBuilder(phase, gpu, dtype, weights, efficiency, predictor)
    e = dtype_bytes(dtype)
    h, layers = config.hidden_size, config.num_layers
    heads, kv_heads = config.num_attention_heads, config.num_kv_heads
    tokens = batch * new_tokens

    def elementwise(read: float, write: float, flops: float) -> KernelCost:
        return KernelCost(flops, (read + write) * e)

    builder.add("embedding", elementwise(tokens * h, tokens * h, 0.0), 1)
    norm = KernelCost(NORM_FLOPS_PER_ELEMENT * tokens * h, (2 * tokens * h + h) * e)
    builder.add("rmsnorm", norm, 2 * layers + 1,
                predict_as=("rms_norm", {"rows": int(tokens), "hidden": h}, "elementwise"))  # fmt: skip
    if config.uses_mla:  # MLA normalises its query and KV latents too
        latent = config.q_lora_rank + config.kv_lora_rank
        latent_norm = KernelCost(NORM_FLOPS_PER_ELEMENT * tokens * latent, (2 * tokens * latent + latent) * e)
        builder.add("latent_rmsnorm", latent_norm, layers)

    # Weight GEMMs of the attention block and dense MLPs, from the model's GEMM list.
    moe_gemms = ("router", "expert_gate_up", "expert_up", "expert_down")
    for shape in gemm_shapes(config, tokens, lm_head_tokens=batch):
        if shape.name in moe_gemms:
            continue
        builder.weight_gemm(shape.name, shape.m, shape.n, shape.k, shape.count)

    rotated_heads = heads + (1 if config.uses_mla else kv_heads)
    rope_elements = tokens * rotated_heads * config.rope_dim
    rope_table = new_tokens * config.rope_dim  # cos and sin, rope_dim/2 each, for the new positions
    builder.add(
        "rope",
        elementwise(rope_elements + rope_table, rope_elements, ROPE_FLOPS_PER_ELEMENT * rope_elements),
        layers,
        predict_as=(
            "apply_rotary",
            {"batch": 1, "heads": rotated_heads, "seq": int(tokens), "head_dim": config.rope_dim},
            "elementwise",
        ),  # fmt: skip
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
        shape = {"batch": batch, "heads_q": heads, "head_dim": config.head_dim, "heads_kv": kv_heads}
        if phase == "decode":
            decode_problem = {**shape, "seq_q": new_tokens, "seq_kv": context}
            attention_as = ("attention_kvcache_fwd", decode_problem, "attention")
        else:
            prefill_problem = {**shape, "seq_q": new_tokens, "seq_kv": context, "causal": causal}
            attention_as = ("flash_attention", prefill_problem, "attention")
        builder.add("attention", attention, layers, predict_as=attention_as)
        attention = None
    if attention is not None:
        builder.add("attention", attention, layers, predict_as=(None, {}, "attention"))

    residual = elementwise(2 * tokens * h, tokens * h, tokens * h)
    builder.add("residual_add", residual, 2 * layers)

    up_width = config.intermediate_size
    if config.num_dense_layers:
        activation_as = None
        if config.gated_mlp:
            activation_as = ("swiglu", {"rows": int(tokens), "width": up_width}, "elementwise")
        builder.add("mlp_activation", _activation(config, tokens, up_width, e), config.num_dense_layers,
                    predict_as=activation_as)  # fmt: skip
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
    builder.add("router", gemm_cost(tokens, experts, h, dtype=builder.dtype), moe_layers,
                predict_as=("gemm", {"m": int(tokens), "n": experts, "k": h}, "gemm"))  # fmt: skip
    # Top-k over fp32 scores: read T*E scores, write k (index int32, weight fp32) per token.
    topk = KernelCost(SOFTMAX_FLOPS_PER_ELEMENT * tokens * experts, 4.0 * tokens * experts + 8.0 * routed)
    builder.add("router_topk", topk, moe_layers)
    builder.add("moe_dispatch", KernelCost(0.0, (tokens * h + routed * h) * e), moe_layers)
    up = (2 if config.gated_mlp else 1) * width
    hit = expected_experts_hit(experts, k, tokens)
    w = builder.weights.bytes_per_element
    gemm_bytes_up = hit * h * up * w + routed * (h + up) * e
    gemm_bytes_down = hit * width * h * w + routed * (width + h) * e
    # Predicted as a batch of GEMMs, one per expert hit, each over its share of the routed tokens.
    experts_hit = max(1, round(hit))
    per_expert = max(1, math.ceil(routed / experts_hit))
    up_problem = {"m": per_expert, "n": up, "k": h, "batch": experts_hit, **builder.storage}
    builder.add(
        "expert_gate_up" if config.gated_mlp else "expert_up",
        KernelCost(2.0 * routed * h * up, gemm_bytes_up),
        moe_layers,
        dequant_share=builder.dequant_share(up_problem),
        predict_as=("gemm", up_problem, "gemm"),
    )
    builder.add("expert_activation", _activation(config, routed, width, e), moe_layers)
    down_problem = {"m": per_expert, "n": h, "k": width, "batch": experts_hit, **builder.storage}
    builder.add(
        "expert_down", KernelCost(2.0 * routed * width * h, gemm_bytes_down), moe_layers,
        dequant_share=builder.dequant_share(down_problem), predict_as=("gemm", down_problem, "gemm"),
    )  # fmt: skip
    if config.num_shared_experts:
        shared = _activation(config, tokens, width * config.num_shared_experts, e)
        builder.add("shared_expert_activation", shared, moe_layers)
    builder.add("moe_combine", KernelCost(2.0 * routed * h, (routed * h + tokens * h) * e), moe_layers)


def _totals(ops: list[InferenceOp]) -> PhaseTotals:
    flops = sum(op.flops for op in ops)
    bytes_moved = sum(op.bytes_moved for op in ops)
    compute_time = sum(op.time_floor_s for op in ops if op.bound == "compute")
    memory_time = sum(op.time_floor_s for op in ops if op.bound == "memory")
    predicted = sum(op.predicted_time_s for op in ops)
    top = max(ops, key=lambda op: op.predicted_time_s) if ops and predicted else None
    return PhaseTotals(
        flops,
        bytes_moved,
        flops / bytes_moved,
        compute_time + memory_time,
        compute_time,
        memory_time,
        "compute" if compute_time > memory_time else "memory",
        sum(op.realistic_time_s for op in ops),
        predicted,
        top.name if top else "",
        top.predicted_bound if top else "",
        top.predicted_time_s / predicted if top else 0.0,
    )


def weights_bytes(config: ModelConfig, dtype: str, storage: WeightStorage | None = None) -> float:
    """Bytes of all weights: the GEMM weights at ``storage`` (default: ``dtype``, no scales), the embedding
    table (and the norms) in ``dtype``. Without ``storage``: param_count(config).total * bytes(dtype)."""
    counts = param_count(config)
    if storage is None:
        return counts.total * dtype_bytes(dtype)
    kept = counts.embedding + counts.norms
    return kept * dtype_bytes(dtype) + (counts.total - kept) * storage.bytes_per_element


def _stage_weights_bytes(shard: ModelConfig, dtype: str, storage: WeightStorage, pp: int) -> float:
    """Weights of the heaviest pipeline stage of one TP shard: ceil(layers/pp) layers' share of the layer
    weights, plus the larger of the embedding (first stage) and the LM head (last stage)."""
    counts = param_count(shard)
    total = weights_bytes(shard, dtype, storage)
    if pp == 1:
        return total
    ends = counts.embedding * dtype_bytes(dtype) + counts.lm_head * storage.bytes_per_element
    layers = total - ends
    heaviest_end = max(counts.embedding * dtype_bytes(dtype), counts.lm_head * storage.bytes_per_element)
    return layers * math.ceil(shard.num_layers / pp) / shard.num_layers + heaviest_end


def _communication(
    config: ModelConfig,
    *,
    tp: int,
    pp: int,
    tokens: int,
    lm_tokens: int,
    dtype: str,
    link_bytes_per_s: float | None,
    algorithm: str,
    efficiency: Efficiency,
) -> Communication:
    """Per-GPU collectives of one forward pass (see the module docstring)."""
    e = dtype_bytes(dtype)
    message = tokens * config.hidden_size * e
    reduces = 2 * config.num_layers if tp > 1 else 0
    logits = lm_tokens * config.vocab_size * e if tp > 1 else 0.0
    sends = pp - 1
    if link_bytes_per_s is None:
        return Communication(reduces, message, logits, sends, message, 0.0, 0.0)

    def time(eff: Efficiency) -> float:
        total = 0.0
        if tp > 1:
            once = all_reduce_time(message, tp, link_bytes_per_s, algorithm=algorithm, efficiency=eff)
            total += reduces * once.time_s
            # Ring all-gather: (tp-1)/tp of the gathered logits cross each link.
            total += eff.collective_latency_s + (tp - 1) / tp * logits / (link_bytes_per_s * eff.collective)
        total += sends * (eff.collective_latency_s + message / (link_bytes_per_s * eff.collective))
        return total

    return Communication(reduces, message, logits, sends, message, time(FLOOR), time(efficiency))


def _has_nvlink_sharp(spec: GPUSpec, link: str) -> bool:
    """NVLink SHARP runs in third-generation NVSwitch chips (Hopper HGX/DGX and later), not over PCIe or the
    two-GPU NVLink bridges of H100 PCIe / NVL cards."""
    return (
        link == "nvlink"
        and spec.architecture in ("Hopper", "Blackwell")
        and not spec.id.startswith(("h100-pcie", "h100-nvl"))
    )


def analyze_inference(
    model: ModelConfig | str,
    gpu: GPUSpec | str,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    decode_tokens: int = 256,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    weight_dtype: str | None = None,
    weight_group_size: int | None = None,
    weight_scale_bytes: float = 2.0,
    tp: int = 1,
    pp: int = 1,
    link: str = "nvlink",
    collective_algorithm: str = "ring",
    efficiency: Efficiency | None = None,
    implementation: str | None = "llm-speed",
    prediction_context: str = "stream",
    calibration: Any = None,
) -> InferenceAnalysis:
    """Per-op FLOPs, bytes, intensity, bound, time floor and realistic time of prefill and of one decode
    step, with totals, TTFT and decode tokens/s (floors and realistic estimates) and the memory per GPU (see
    the module docstring for the model).

    ``model``: ModelConfig, zoo id or config.json path; ``gpu``: GPUSpec or id; ``dtype``: activations and
    compute; ``kv_dtype``: the KV cache (default ``dtype``; e.g. "fp8" or "int4"); ``weight_dtype``: weight
    storage (default ``dtype``; "int8", "int4", "fp8") with one ``weight_scale_bytes`` scale per
    ``weight_group_size`` weights (None: per channel, negligible). ``tp``/``pp``: tensor/pipeline-parallel
    degrees, communicating over ``link`` ("nvlink" or "pcie") with ``collective_algorithm`` ("ring", "tree",
    "nvls"). ``efficiency``: the factors of the realistic estimate (default :class:`Efficiency`).
    ``implementation``: whose kernels the calibrated predictions (:mod:`llm_speed.perf.predict`) are of
    ("llm-speed", "vendor": cuBLAS, torch's SDPA, eager PyTorch; None: no prediction), in
    ``prediction_context`` ("stream": kernels back to back, the host path showing where it is longer than
    the kernel; "graph": CUDA-graph replay, no host path); ``calibration``: another calibration file.
    """
    config = resolve_model(model)
    spec = get_gpu(gpu)
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    positive_int("decode_tokens", decode_tokens)
    tp, pp = positive_int("tp", tp), positive_int("pp", pp)
    if pp > config.num_layers:
        raise ValueError(f"pp ({pp}) must be <= the number of layers of {config.name} ({config.num_layers})")
    dtype_name = normalize_dtype(dtype)
    kv_name = dtype_name if kv_dtype is None else normalize_dtype(kv_dtype)
    spec.peak_flops(dtype_name)  # a dtype this GPU has no peak for fails here, naming the accepted ones
    storage = weight_storage(
        weight_dtype, dtype_name, group_size=weight_group_size, scale_bytes=weight_scale_bytes
    )
    eff = Efficiency() if efficiency is None else efficiency
    if not isinstance(eff, Efficiency):
        raise TypeError(f"efficiency must be an Efficiency, got {type(eff).__name__}")
    if collective_algorithm not in ("ring", "tree", "nvls"):
        raise ValueError(
            f"collective_algorithm must be one of ring, tree, nvls, got {collective_algorithm!r}"
        )
    shard = tp_shard(config, tp)
    link_speed = link_bandwidth(spec, link) if tp * pp > 1 else None
    if collective_algorithm == "nvls" and not _has_nvlink_sharp(spec, link):
        raise ValueError(
            "collective_algorithm 'nvls' (NVLink SHARP) needs third-generation NVSwitch (H100/H200/H800/"
            f"GH200/B200 SXM systems) and link='nvlink'; {spec.id} over {link} has none: use 'ring' or 'tree'"
        )
    decode_context = seq_len + decode_tokens // 2
    predictor = None
    if implementation is not None:
        predictor = Predictor(spec, implementation, prediction_context, calibration)
    common = dict(weights=storage, efficiency=eff, predictor=predictor)
    prefill_ops = _phase_ops(
        shard,
        spec,
        dtype_name,
        kv_name,
        phase="prefill",
        batch=batch_size,
        new_tokens=seq_len,
        context=seq_len,
        **common,
    )
    decode_ops = _phase_ops(
        shard,
        spec,
        dtype_name,
        kv_name,
        phase="decode",
        batch=batch_size,
        new_tokens=1,
        context=decode_context,
        **common,
    )
    comm_args = dict(
        tp=tp,
        pp=pp,
        dtype=dtype_name,
        link_bytes_per_s=link_speed,
        algorithm=collective_algorithm,
        efficiency=eff,
    )
    prefill_comm = _communication(config, tokens=batch_size * seq_len, lm_tokens=batch_size, **comm_args)
    decode_comm = _communication(config, tokens=batch_size, lm_tokens=batch_size, **comm_args)
    prefill, decode = _totals(prefill_ops), _totals(decode_ops)
    ttft = prefill.time_floor_s + prefill_comm.floor_s
    step = decode.time_floor_s + decode_comm.floor_s
    ttft_real = prefill.realistic_time_s + prefill_comm.realistic_s
    step_real = decode.realistic_time_s + decode_comm.realistic_s

    predicted = {}
    if predictor is not None:
        peak = spec.peak_flops(dtype_name)
        ttft_p = prefill.predicted_time_s + prefill_comm.realistic_s
        step_p = decode.predicted_time_s + decode_comm.realistic_s
        # Whether the GPU has measurements of its own: its 16-bit GEMM entry says (the streaming rows never
        # do; another dtype's GEMM is uncalibrated on any GPU). fp16 or bf16, whichever the GPU has a peak
        # for (a T4 has no bf16, a user's spec may have neither: then the analysed dtype's row).
        probe_dtype = next((name for name in ("fp16", "bf16") if name in spec.peak_tflops), dtype_name)
        probe = predict(gemm_op_for(probe_dtype), spec, implementation=implementation,
                        context=prediction_context, calibration=calibration, m=1, n=config.hidden_size,
                        k=config.hidden_size, dtype=probe_dtype)  # fmt: skip
        predicted = dict(
            implementation=probe.implementation if implementation != "vendor" else "vendor",
            prediction_context=prediction_context,
            prediction_calibrated=probe.calibrated,
            prediction_source=probe.source,
            ttft_predicted_s=ttft_p,
            decode_step_predicted_s=step_p,
            decode_tokens_per_s_predicted=batch_size / step_p,
            total_time_predicted_s=ttft_p + decode_tokens * step_p,
            prefill_mfu_predicted=prefill.flops / ttft_p / peak,
            decode_mfu_predicted=decode.flops / step_p / peak,
        )

    weights = weights_bytes(config, dtype_name, storage)
    kv_total = kv_cache_size(
        config, seq_len=seq_len + decode_tokens, batch_size=batch_size, dtype=kv_name
    ).total_bytes
    # KV heads split over tp (replicated beyond them; MLA's shared latent is replicated), layers over pp.
    kv_split = 1 if config.uses_mla else min(tp, config.num_kv_heads)
    kv_per_gpu = kv_total / kv_split * math.ceil(config.num_layers / pp) / config.num_layers
    weights_per_gpu = _stage_weights_bytes(shard, dtype_name, storage, pp)
    per_gpu = weights_per_gpu + kv_per_gpu
    required = weights + kv_total
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
        ttft_s=ttft,
        decode_step_s=step,
        time_per_output_token_s=step,
        decode_tokens_per_s=batch_size / step,
        total_time_s=ttft + decode_tokens * step,
        weights_bytes=weights,
        kv_cache_bytes=kv_total,
        memory_required_bytes=required,
        gpu_memory_bytes=spec.usable_memory_bytes,
        fits_in_memory=per_gpu <= spec.usable_memory_bytes,
        max_position_embeddings=config.max_position_embeddings,
        exceeds_max_position=seq_len + decode_tokens > config.max_position_embeddings,
        weight_dtype=storage.dtype,
        weight_bytes_per_element=storage.bytes_per_element,
        tp=tp,
        pp=pp,
        collective_algorithm=collective_algorithm,
        efficiency_source=eff.source,
        weights_bytes_per_gpu=weights_per_gpu,
        kv_cache_bytes_per_gpu=kv_per_gpu,
        memory_per_gpu_bytes=per_gpu,
        prefill_communication=prefill_comm,
        decode_communication=decode_comm,
        ttft_realistic_s=ttft_real,
        decode_step_realistic_s=step_real,
        decode_tokens_per_s_realistic=batch_size / step_real,
        total_time_realistic_s=ttft_real + decode_tokens * step_real,
        **predicted,
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
                fits_in_memory=required <= spec.usable_memory_bytes,
            )
        )
    return rows
