"""Distributed training costs: collectives, ZeRO model-state memory, TP/PP/DP/EP/CP layouts, pipeline bubbles,
MoE all-to-all, and a per-GPU memory breakdown (:func:`train_memory`).

Sources: ring collectives — Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations" (JPDC 2009) and NCCL's "Performance" notes (bus bandwidth = algorithm bandwidth x 2(n-1)/n for
all-reduce, (n-1)/n for all-gather/reduce-scatter): time 2(N-1)(latency + D/(N bandwidth)).
ZeRO — Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(arXiv:1910.02054), sections 3 and 5 (16 bytes/param, 120/31.4/16.6/1.9 GB for 7.5B params on 64 GPUs) and
section 7 (communication 2x vs 3x the parameters). Tensor parallelism — Shoeybi et al., Megatron-LM
(arXiv:1909.08053), section 3: two all-reduces per layer in forward, two in backward. Pipeline bubbles — Huang
et al., GPipe (arXiv:1811.06965); Narayanan et al. (arXiv:2104.04473), section 2.2: (p-1)/m of ideal time for
1F1B, (p-1)/(v*m) interleaved. MoE all-to-all — Lepikhin et al., GShard (arXiv:2006.16668), section 2:
each token's top-k copies of d elements are dispatched and combined (B*top_k*d*bytes per all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.core.gpus import GPUSpec, dtype_bytes, get_gpu, normalize_dtype
from llm_speed.perf._checks import divisors_text
from llm_speed.perf.kv_cache import kv_elements_per_token_per_layer
from llm_speed.perf.models import ModelConfig, attention_params_per_layer, mlp_params, resolve_model
from llm_speed.perf.training import (
    PIPELINE_SCHEDULES,
    activation_bytes_per_layer,
    check_virtual_stages,
    microbatches_in_flight,
    stage_layer_mix,
)

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
ZERO_STAGES = (0, 1, 2, 3)
MIXED_PRECISION_ADAM_BYTES_PER_PARAM = 16  # fp16/bf16 params 2 + grads 2 + fp32 master params, m and v 12
LINKS = ("nvlink", "pcie")


# --- collectives ---


@dataclass(frozen=True)
class CollectiveCost:
    """One ring collective among ``num_gpus``; ``size_bytes`` is the full buffer each GPU holds (all-reduce
    input, reduce-scatter input, all-gather output, all-to-all send buffer)."""

    op: str
    num_gpus: int
    size_bytes: float
    steps: int
    bytes_per_step: float
    bytes_sent_per_gpu: float
    time_s: float


def link_bandwidth(gpu: GPUSpec | str, link: str = "nvlink") -> float:
    """One direction's bytes/s per GPU over ``link`` ("nvlink" or "pcie"): half the datasheet's bidirectional
    total (see :mod:`llm_speed.core.gpus`). A GPU without NVLink raises ValueError."""
    spec = get_gpu(gpu)
    if link not in LINKS:
        raise ValueError(f"link must be one of {', '.join(LINKS)}, got {link!r}")
    if link == "pcie":
        return spec.pcie_unidirectional_bytes_per_s()
    bandwidth = spec.nvlink_unidirectional_bytes_per_s()
    if bandwidth is None:
        raise ValueError(f"{spec.id} has no NVLink; use link='pcie'")
    return bandwidth


def collective_cost(
    op: str, size_bytes: float, num_gpus: int, bandwidth_bytes_per_s: float, *, latency_s: float = 0.0
) -> CollectiveCost:
    """Ring algorithm cost, per GPU, for a buffer of D bytes among N GPUs, link bandwidth B, step latency a:

    * all_reduce: 2(N-1) steps of D/N (reduce-scatter then all-gather); sends 2(N-1)D/N, which tends to 2D
      and is independent of N; time 2(N-1)(a + D/(N B)).
    * reduce_scatter / all_gather: N-1 steps of D/N; sends (N-1)D/N; time (N-1)(a + D/(N B)).
    * all_to_all (pairwise exchange): N-1 steps, each sending the D/N destined for one peer; same as above.

    N = 1 costs nothing.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {', '.join(COLLECTIVES)}, got {op!r}")
    size = non_negative_number("size_bytes", size_bytes)
    n = positive_int("num_gpus", num_gpus)
    bandwidth = non_negative_number("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    if bandwidth == 0:
        raise ValueError("bandwidth_bytes_per_s must be > 0")
    latency = non_negative_number("latency_s", latency_s)
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    per_step = size / n
    return CollectiveCost(
        op=op,
        num_gpus=n,
        size_bytes=size,
        steps=steps,
        bytes_per_step=per_step,
        bytes_sent_per_gpu=steps * per_step,
        time_s=steps * (latency + per_step / bandwidth),
    )


# --- ZeRO model states ---


@dataclass(frozen=True)
class ModelStateMemory:
    """Per-GPU bytes of parameters, gradients and optimizer states for ``num_params`` parameters."""

    num_params: float
    dp: int
    zero_stage: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    total_bytes: float

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / self.num_params if self.num_params else 0.0


def model_state_memory(
    num_params: float,
    *,
    dp: int = 1,
    zero_stage: int = 0,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> ModelStateMemory:
    """Mixed-precision Adam model states per GPU with ZeRO (Rajbhandari et al. 2020, section 3.1 and Fig. 1).

    Per parameter: 2 bytes of 16-bit weights, 2 of 16-bit gradients, K = 12 of fp32 master weights, momentum
    and variance: 16 bytes. ZeRO shards over the N = ``dp`` data-parallel ranks: stage 1 the optimizer states
    (2+2+K/N), stage 2 also gradients (2 + (2+K)/N), stage 3 also parameters ((2+2+K)/N).
    Example (the paper's): 7.5e9 params, N = 64: 120, 31.4, 16.6 and 1.9 GB for stages 0..3.
    """
    params = non_negative_number("num_params", num_params)
    n = positive_int("dp", dp)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    p = params * param_bytes / (n if zero_stage >= 3 else 1)
    g = params * grad_bytes / (n if zero_stage >= 2 else 1)
    o = params * optimizer_bytes / (n if zero_stage >= 1 else 1)
    return ModelStateMemory(params, n, zero_stage, p, g, o, p + g + o)


def zero_communication_bytes(num_params: float, *, dp: int, zero_stage: int, param_bytes: float = 2) -> float:
    """Bytes each GPU sends per step for gradient sync (Rajbhandari et al. 2020, section 7, ring algorithms):
    stages 0-2: reduce-scatter + all-gather = an all-reduce, 2(N-1)/N * Psi * e (~2 Psi); stage 3 adds an
    all-gather of parameters for forward and one for backward: 3(N-1)/N * Psi * e (~3 Psi, 1.5x)."""
    params = non_negative_number("num_params", num_params)
    n = positive_int("dp", dp)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    volumes = 3 if zero_stage == 3 else 2
    return volumes * (n - 1) / n * params * param_bytes


# --- tensor, pipeline, context and expert parallelism ---


@dataclass(frozen=True)
class TPCommunication:
    """Tensor-parallel traffic of one layer for one micro-batch (Megatron: column- then row-parallel, so one
    all-reduce after attention and one after the MLP in forward, two more in backward)."""

    all_reduces_forward: int
    all_reduces_backward: int
    message_bytes: float  # b * s * h * e, the activation each all-reduce sums
    bytes_sent_per_gpu: float  # all four all-reduces
    time_s: float | None  # with a bandwidth given


def tp_communication_per_layer(
    config: ModelConfig | str,
    *,
    seq_len: int,
    micro_batch_size: int,
    tp: int,
    dtype: Any = "bf16",
    bandwidth_bytes_per_s: float | None = None,
    latency_s: float = 0.0,
) -> TPCommunication:
    """4 all-reduces of b*s*h*e bytes per layer and micro-batch (2 forward, 2 backward; Shoeybi et al. 2019,
    section 3). Sequence parallelism replaces each with a reduce-scatter + all-gather of the same total volume
    (Korthikanti et al. 2022, section 4.2.2), so the bytes are the same."""
    config = resolve_model(config)
    t = positive_int("tp", tp)
    message = (
        positive_int("seq_len", seq_len)
        * positive_int("micro_batch_size", micro_batch_size)
        * config.hidden_size
        * dtype_bytes(dtype)
    )
    sent = 4 * 2 * (t - 1) / t * message
    time = None
    if bandwidth_bytes_per_s is not None:
        time = (
            4 * collective_cost("all_reduce", message, t, bandwidth_bytes_per_s, latency_s=latency_s).time_s
        )
    return TPCommunication(2, 2, message, sent, time)


@dataclass(frozen=True)
class PipelineBubble:
    """Idle share of a pipeline step. ``bubble_fraction`` = bubble / (ideal + bubble) (share of the step);
    ``bubble_to_ideal`` = bubble / ideal (Megatron's form, (p-1)/m)."""

    schedule: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    bubble_fraction: float
    bubble_to_ideal: float
    microbatches_in_flight: float  # micro-batches the first stage stashes at peak (training.py)


def pipeline_bubble(
    pp: int, num_microbatches: int, *, schedule: str = "1f1b", virtual_stages: int = 1
) -> PipelineBubble:
    """Pipeline bubble for p stages and m micro-batches.

    GPipe and 1F1B: (p-1)/(m+p-1) of the step ((p-1)/m of ideal); they differ in memory: GPipe stashes
    all m micro-batches, 1F1B at most p. Interleaved 1F1B with v virtual stages per GPU: (p-1)/(m*v+p-1)
    ((p-1)/(v*m) of ideal), and needs m to be a multiple of p (Narayanan et al. 2021, section 2.2).
    """
    p = positive_int("pp", pp)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("virtual_stages", virtual_stages)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if schedule != "interleaved" and v != 1:
        raise ValueError(f"virtual_stages > 1 needs schedule='interleaved', got schedule={schedule!r}")
    if schedule == "interleaved" and m % p:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({m}) to be a multiple of pp ({p})"
        )
    work = m * v if schedule == "interleaved" else m
    in_flight = microbatches_in_flight(schedule, p, m, virtual_stages=v)
    return PipelineBubble(schedule, p, m, v, (p - 1) / (work + p - 1), (p - 1) / work, in_flight)


@dataclass(frozen=True)
class MoEAllToAll:
    """Expert-parallel all-to-all traffic of one MoE layer, per GPU.

    ``bytes_per_all_to_all`` = tokens * top_k * d * e (every routed copy counted); of that,
    (EP-1)/EP leaves the GPU on average under uniform routing (``remote_bytes_per_all_to_all``). Forward runs
    two all-to-alls (dispatch, combine); backward two more.
    """

    tokens_per_gpu: int
    experts_per_token: int
    hidden_size: int
    ep: int
    bytes_per_all_to_all: float
    remote_bytes_per_all_to_all: float
    forward_bytes_per_layer: float
    training_bytes_per_layer: float
    forward_time_per_layer_s: float | None


def moe_all_to_all(
    *,
    tokens_per_gpu: int,
    hidden_size: int,
    experts_per_token: int,
    ep: int,
    dtype: Any = "bf16",
    bandwidth_bytes_per_s: float | None = None,
) -> MoEAllToAll:
    """All-to-all volume of one MoE layer (GShard, section 2): one all-to-all sends B * top_k * d * e bytes
    per GPU; a layer needs two in forward (dispatch + combine) and two in backward.
    Example: B = 4096, top_k = 2, d = 4096, fp16: 64 MiB per all-to-all, 128 MiB per layer,
    8 GiB over 64 MoE layers. The time uses the remote share on a ring."""
    b = positive_int("tokens_per_gpu", tokens_per_gpu)
    d = positive_int("hidden_size", hidden_size)
    k = positive_int("experts_per_token", experts_per_token)
    n = positive_int("ep", ep)
    one = b * k * d * dtype_bytes(dtype)
    remote = one * (n - 1) / n
    time = None
    if bandwidth_bytes_per_s is not None:
        time = 2 * collective_cost("all_to_all", one, n, bandwidth_bytes_per_s).time_s
    return MoEAllToAll(b, k, d, n, one, remote, 2 * one, 4 * one, time)


def context_parallel_kv_bytes_per_layer(
    config: ModelConfig | str, *, seq_len: int, micro_batch_size: int, cp: int, dtype: Any = "bf16"
) -> float:
    """Ring attention (context parallelism): each GPU holds seq/cp tokens and receives the other cp-1 chunks
    of K and V in forward: (cp-1) * b * (s/cp) * 2 * Hkv * d * e bytes per layer (MLA: the latent instead)."""
    config = resolve_model(config)
    c = positive_int("cp", cp)
    s = positive_int("seq_len", seq_len)
    if s % c:
        raise ValueError(f"cp ({c}) must divide seq_len ({s})")
    per_token = kv_elements_per_token_per_layer(config) * dtype_bytes(dtype)
    return (c - 1) * positive_int("micro_batch_size", micro_batch_size) * (s // c) * per_token


def gradient_accumulation_steps(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """K = global_batch / (micro_batch * dp): micro-batches each DP rank runs before one optimizer step (one
    gradient all-reduce per K micro-batches; mathematically the same gradient as the big batch)."""
    g = positive_int("global_batch_size", global_batch_size)
    per_step = positive_int("micro_batch_size", micro_batch_size) * positive_int("dp", dp)
    if g % per_step:
        raise ValueError(f"global_batch_size ({g}) must be a multiple of micro_batch_size * dp ({per_step})")
    return g // per_step


# --- the per-GPU breakdown ---


@dataclass(frozen=True)
class TrainMemory:
    """Memory of the most loaded GPU for one training layout, plus its communication and bubble."""

    model: str
    gpus: int
    tp: int
    pp: int
    dp: int
    ep: int
    cp: int
    zero_stage: int
    micro_batch_size: int
    seq_len: int
    num_microbatches: int
    schedule: str
    virtual_stages: int  # model chunks per pipeline stage (interleaved schedule; 1 otherwise)
    recompute: str
    sequence_parallel: bool
    stage: int  # pipeline stage of the most loaded GPU
    stage_layers: int  # transformer layers on that stage (stages differ by one when pp does not divide L)
    params_per_gpu: float
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    total_bytes: float
    gpu: str | None
    gpu_memory_bytes: float | None
    fits: bool | None
    bubble_fraction: float
    tp_bytes_per_layer: float
    dp_grad_sync_bytes: float  # per GPU per optimizer step
    moe_all_to_all_bytes_per_layer: float  # forward + backward, per GPU


def _stage_params(config: ModelConfig, stage: int, pp: int, tp: int, ep: int) -> tuple[float, float]:
    """(non-expert params, routed-expert params) one GPU of pipeline ``stage`` holds. Attention, MLP, shared
    experts, embedding and LM head are split by TP (norms and the router replicated); routed experts by
    EP x TP (Megatron's expert tensor parallelism defaults to TP). The first stage holds the embedding, the
    last the LM head (both when pp = 1, once when tied)."""
    dense, moe = stage_layer_mix(config, stage, pp)
    per_stage = dense + moe
    h = config.hidden_size
    layer_common = attention_params_per_layer(config) / tp + 2 * h
    params = per_stage * layer_common
    params += dense * mlp_params(h, config.intermediate_size, config.gated_mlp) / tp
    experts = 0.0
    if moe:
        expert = mlp_params(h, config.moe_intermediate_size, config.gated_mlp)
        router = h * config.num_experts + (config.num_experts if config.router_bias else 0)
        params += moe * (expert * config.num_shared_experts / tp + router)
        experts = moe * expert * config.num_experts / (ep * tp)
    embedding = config.vocab_size * h / tp
    if stage == 0:
        params += embedding
    if stage == pp - 1:
        params += h + (0 if config.tie_embeddings and pp == 1 else embedding)
    return params, experts


def train_memory(
    model: ModelConfig | str,
    *,
    gpus: int,
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    zero: int = 0,
    micro_batch_size: int = 1,
    seq_len: int = 4096,
    num_microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    sequence_parallel: bool | None = None,
    recompute: str = "none",
    flash_attention: bool = True,
    dtype: Any = "bf16",
    gpu: GPUSpec | str | None = None,
    link: str = "nvlink",
) -> TrainMemory:
    """Per-GPU memory of training ``model`` on ``gpus`` = tp * pp * dp * cp GPUs, mixed-precision Adam.

    Model states: :func:`model_state_memory` (16 bytes/param, ZeRO over the dp*cp ranks that hold the same
    shard; routed experts over dp*cp/ep). Activations: :func:`training.activation_bytes_per_layer` at
    seq_len/cp tokens per GPU, times the micro-batches the stage stashes (1F1B: p-stage, at most m; GPipe: m;
    interleaved: 1F1B x (1 + (p-1)/(p*v)) on stage 0). Reported for the stage with the largest total. Also the
    bubble (:func:`pipeline_bubble`), TP bytes per layer, DP gradient-sync bytes and MoE all-to-all bytes.

    Layers are split over the stages as evenly as possible (:func:`training.pipeline_stage_layers`).
    Constraints (ValueError): tp*pp*dp*cp = gpus; tp divides heads and KV heads; pp <= layers; ep divides
    dp*cp and the expert count; cp divides seq_len. ``dp`` defaults to gpus / (tp*pp*cp);
    ``num_microbatches`` to pp (the fewest that fill 1F1B); ``sequence_parallel`` to tp > 1.
    """
    config = resolve_model(model)
    n = positive_int("gpus", gpus)
    t, p, e, c = (positive_int(k, v) for k, v in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)))
    split_heads = config.num_attention_heads if config.uses_mla else config.num_kv_heads
    if config.num_attention_heads % t or split_heads % t:
        raise ValueError(
            f"tp ({t}) must divide num_attention_heads ({config.num_attention_heads}) and num_kv_heads "
            f"({config.num_kv_heads}) of {config.name}; "
            f"valid tp: {divisors_text(split_heads)}"
        )
    if dp is None:
        if n % (t * p * c):
            raise ValueError(f"gpus ({n}) must be a multiple of tp*pp*cp ({t * p * c})")
        dp = n // (t * p * c)
    d = positive_int("dp", dp)
    if t * p * d * c != n:
        raise ValueError(f"tp*pp*dp*cp = {t}*{p}*{d}*{c} = {t * p * d * c} must equal gpus ({n})")
    if p > config.num_layers:
        raise ValueError(f"pp ({p}) must be at most num_layers ({config.num_layers}) of {config.name}")
    virtual_stages = check_virtual_stages(config, p, virtual_stages)
    if e > 1 and not config.is_moe:
        raise ValueError(f"ep ({e}) > 1 needs an MoE model; {config.name} is dense")
    if (d * c) % e or (config.is_moe and config.num_experts % e):
        raise ValueError(f"ep ({e}) must divide dp*cp ({d * c}) and the expert count ({config.num_experts})")
    if seq_len % c:
        raise ValueError(f"cp ({c}) must divide seq_len ({seq_len})")
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    m = p if num_microbatches is None else positive_int("num_microbatches", num_microbatches)
    bubble = pipeline_bubble(p, m, schedule=schedule, virtual_stages=virtual_stages)
    sp = t > 1 if sequence_parallel is None else bool(sequence_parallel)
    dtype_name = normalize_dtype(dtype)
    spec = get_gpu(gpu) if gpu is not None else None

    def layer_activation(is_moe: bool) -> float:
        return activation_bytes_per_layer(
            config,
            seq_len=seq_len // c,
            micro_batch_size=micro_batch_size,
            tp=t,
            sequence_parallel=sp,
            recompute=recompute,
            flash_attention=flash_attention,
            moe=is_moe,
        )

    dense_act = layer_activation(False)
    moe_act = layer_activation(True) if config.is_moe else 0.0
    best = None
    for stage in range(p):
        dense_params, expert_params = _stage_params(config, stage, p, t, e)
        states = model_state_memory(dense_params, dp=d * c, zero_stage=zero)
        expert_states = model_state_memory(expert_params, dp=d * c // e, zero_stage=zero)
        dense_layers, moe_layers = stage_layer_mix(config, stage, p)
        stage_act = dense_layers * dense_act + moe_layers * moe_act
        in_flight = microbatches_in_flight(schedule, p, m, virtual_stages=virtual_stages, stage=stage)
        activations = stage_act * in_flight
        total = states.total_bytes + expert_states.total_bytes + activations
        if best is None or total > best[0]:
            best = (total, stage, states, expert_states, activations, dense_params + expert_params)
    total, stage, states, expert_states, activations, params = best

    tp_bytes = tp_communication_per_layer(
        config, seq_len=seq_len // c, micro_batch_size=micro_batch_size, tp=t, dtype=dtype_name
    ).bytes_sent_per_gpu
    dense_params, expert_params = _stage_params(config, stage, p, t, e)
    dp_sync = zero_communication_bytes(dense_params, dp=d * c, zero_stage=zero) + zero_communication_bytes(
        expert_params, dp=d * c // e, zero_stage=zero
    )
    a2a = 0.0
    if config.is_moe:
        a2a = (
            moe_all_to_all(
                tokens_per_gpu=micro_batch_size * seq_len // c,
                hidden_size=config.hidden_size,
                experts_per_token=config.experts_per_token,
                ep=e,
                dtype=dtype_name,
            ).training_bytes_per_layer
            if e > 1
            else 0.0
        )
    capacity = spec.usable_memory_bytes if spec else None
    return TrainMemory(
        model=config.name,
        gpus=n,
        tp=t,
        pp=p,
        dp=d,
        ep=e,
        cp=c,
        zero_stage=zero,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        num_microbatches=m,
        schedule=schedule,
        virtual_stages=virtual_stages,
        recompute=recompute,
        sequence_parallel=sp,
        stage=stage,
        stage_layers=sum(stage_layer_mix(config, stage, p)),
        params_per_gpu=params,
        params_bytes=states.params_bytes + expert_states.params_bytes,
        grads_bytes=states.grads_bytes + expert_states.grads_bytes,
        optimizer_bytes=states.optimizer_bytes + expert_states.optimizer_bytes,
        activation_bytes=activations,
        total_bytes=total,
        gpu=spec.id if spec else None,
        gpu_memory_bytes=capacity,
        fits=None if capacity is None else total <= capacity,
        bubble_fraction=bubble.bubble_fraction,
        tp_bytes_per_layer=tp_bytes,
        dp_grad_sync_bytes=dp_sync,
        moe_all_to_all_bytes_per_layer=a2a,
    )
