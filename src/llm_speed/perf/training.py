"""Training FLOPs (6ND and the exact per-layer count) and activation memory (with and without recomputation).

Sources:

* 6ND: Kaplan et al., "Scaling Laws for Neural Language Models" (arXiv:2001.08361), section 2.1: C ~ 6N per
  token (2N forward, 4N backward); used by Hoffmann et al. (Chinchilla, arXiv:2203.15556).
* Exact count: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473), section 5.1 / appendix: a layer's forward pass is 24Bsh^2 + 4Bs^2h, the
  logit layer 2BshV, backward is twice the forward, full recomputation adds one more forward.
* Activation memory: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), section 4 and Table 2: sbh(34 + 5as/h) bytes per layer with 16-bit activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.perf.models import ModelConfig, param_count, resolve_model

RECOMPUTE_MODES = ("none", "selective", "full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
_BACKWARD_TO_FORWARD = 2  # dX and dW: two GEMMs of the forward's size for every forward GEMM


def _check_recompute(recompute: str) -> str:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    return recompute


def training_flops_6nd(num_params: float, num_tokens: float) -> float:
    """C = 6 * N * D: forward 2N and backward 4N FLOPs per token (Kaplan et al. 2020, section 2.1).

    Example: Chinchilla, 70e9 parameters on 1.4e12 tokens, 5.88e23 FLOPs.
    """
    return 6.0 * non_negative_number("num_params", num_params) * non_negative_number("num_tokens", num_tokens)


def megatron_training_flops(
    *,
    batch_size: int,
    seq_len: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    recompute: bool = True,
) -> float:
    """Megatron-LM's training FLOPs per iteration for a GPT model (Narayanan et al. 2021, eq. 3).

    With full activation recomputation: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    Without: F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (forward + backward only).
    Assumes MHA, a 4h non-gated MLP and counts the full s x s attention (no causal halving).
    """
    b, s, l, h, v = (
        positive_int(n, x)
        for n, x in (
            ("batch_size", batch_size),
            ("seq_len", seq_len),
            ("num_layers", num_layers),
            ("hidden_size", hidden_size),
            ("vocab_size", vocab_size),
        )
    )
    if recompute:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


@dataclass(frozen=True)
class SelectiveRecomputeFlops:
    """Training FLOPs per iteration with Korthikanti et al.'s selective activation recomputation, counted as
    that paper counts them: model FLOPs, hardware FLOPs (with the recomputation), the difference, and the
    overhead (difference / model FLOPs)."""

    model_flops: float
    hardware_flops: float
    recompute_flops: float
    overhead: float


def korthikanti_selective_recompute_flops(
    *, batch_size: int, seq_len: int, num_layers: int, hidden_size: int, vocab_size: int
) -> SelectiveRecomputeFlops:
    """Selective activation recomputation as Korthikanti et al. 2022 (arXiv:2205.05198) count it: model FLOPs
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` (no recomputation, Narayanan et al. eq. 3), hardware FLOPs
    ``72 B s l h^2 (1 + s/(3h) + V/(12 l h))`` (section 6): the recomputation of the attention core (QK^T,
    softmax, dropout, attention over V) is counted as ``12 B s^2 l h``, its forward and backward share of
    the model count once more. GPT (MHA, 4h MLP), non-causal.

    Reproduces section 4.2's figures (tests/perf/test_training.py): the FLOPs overhead of selective
    recomputation is 2.7% for GPT-3 175B (s = 2048, h = 12288, l = 96, V = 51200) and 1.6% for MT-NLG 530B
    (h = 20480, l = 105). The count of the work the recomputation itself executes, one more forward of the
    core (``4 B s^2 h`` per layer: :func:`training_flops` with ``recompute="selective"``), is a third of it:
    0.9% for GPT-3.
    """
    b, s, l, h, v = (
        positive_int(n, x)
        for n, x in (
            ("batch_size", batch_size),
            ("seq_len", seq_len),
            ("num_layers", num_layers),
            ("hidden_size", hidden_size),
            ("vocab_size", vocab_size),
        )
    )
    base = 72.0 * b * s * l * h * h
    model = base * (1 + s / (6 * h) + v / (12 * l * h))
    hardware = base * (1 + s / (3 * h) + v / (12 * l * h))
    return SelectiveRecomputeFlops(model, hardware, hardware - model, (hardware - model) / model)


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one kind of layer ("dense" or "moe"), per layer; ``count`` layers of this kind."""

    kind: str
    count: int
    attention_projections: float  # QKV (or MLA's q/kv down- and up-projections) and the output projection
    attention_scores: float  # Q K^T
    attention_values: float  # P V
    mlp: float  # dense MLP, or router + shared experts + the top-k routed experts

    @property
    def attention_core(self) -> float:
        return self.attention_scores + self.attention_values

    @property
    def total(self) -> float:
        return self.attention_projections + self.attention_core + self.mlp


@dataclass(frozen=True)
class TrainingFlops:
    """FLOPs of one training step over ``tokens`` tokens.

    ``model_flops`` = forward + backward (what MFU counts); ``hardware_flops`` adds recomputation (HFU).
    ``six_nd`` is 6 * N * tokens with N the active parameters that do FLOPs (the embedding lookup does none).
    """

    model: str
    batch_size: int
    seq_len: int
    tokens: int
    causal: bool
    recompute: str
    layers: tuple[LayerFlops, ...]
    lm_head: float
    forward: float
    backward: float
    recompute_flops: float
    model_flops: float
    hardware_flops: float
    six_nd: float


def _attention_projection_flops(config: ModelConfig, tokens: int) -> float:
    """2 * tokens * (weights of the attention block's GEMMs), MLA included."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.uses_mla:
        q_width = heads * config.qk_head_dim
        q = (h * config.q_lora_rank + config.q_lora_rank * q_width) if config.q_lora_rank else h * q_width
        kv = h * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank * heads * (
            config.qk_nope_head_dim + config.v_head_dim
        )
        return 2.0 * tokens * (q + kv + heads * config.v_head_dim * h)
    qkv = h * (heads + 2 * config.num_kv_heads) * config.head_dim
    return 2.0 * tokens * (qkv + heads * config.head_dim * h)


def attention_pairs(seq_len: int, *, causal: bool, sliding_window: int | None = None) -> int:
    """Query-key pairs one head computes: s^2; causal s(s+1)/2; a window w keeps min(i+1, w) keys in row i."""
    s = seq_len
    if not causal:
        return s * s if sliding_window is None else s * min(s, sliding_window)
    if sliding_window is None or sliding_window >= s:
        return s * (s + 1) // 2
    w = sliding_window
    return w * (w + 1) // 2 + (s - w) * w


def forward_layer_flops(
    config: ModelConfig | str, *, batch_size: int, seq_len: int, causal: bool = True
) -> tuple[LayerFlops, ...]:
    """Exact forward FLOPs per layer (one entry per layer kind), counting multiply-adds as 2 FLOPs.

    Attention projections: 2T x weights (T = batch*seq tokens). Scores: 2 * B * H * pairs * d_qk; values:
    2 * B * H * pairs * d_v, with pairs from :func:`attention_pairs` (causal and sliding window aware).
    Dense MLP: 2T x (3hI gated | 2hI). MoE: router 2ThE + shared experts 2T x 3hI_moe x n_shared + routed
    2T x k x 3hI_moe. Norms, RoPE and softmax are elementwise and left out, as Megatron does.
    """
    config = resolve_model(config)
    positive_int("batch_size", batch_size)
    positive_int("seq_len", seq_len)
    tokens = batch_size * seq_len
    h, heads = config.hidden_size, config.num_attention_heads
    pairs = attention_pairs(seq_len, causal=causal, sliding_window=config.sliding_window)
    projections = _attention_projection_flops(config, tokens)
    scores = 2.0 * batch_size * heads * pairs * config.qk_head_dim
    values = 2.0 * batch_size * heads * pairs * config.value_head_dim
    gates = 3 if config.gated_mlp else 2
    layers = []
    if config.num_dense_layers:
        mlp = 2.0 * tokens * gates * h * config.intermediate_size
        layers.append(LayerFlops("dense", config.num_dense_layers, projections, scores, values, mlp))
    if config.num_moe_layers:
        expert = 2.0 * gates * h * config.moe_intermediate_size
        mlp = 2.0 * tokens * h * config.num_experts + tokens * expert * (
            config.num_shared_experts + config.experts_per_token
        )
        layers.append(LayerFlops("moe", config.num_moe_layers, projections, scores, values, mlp))
    return tuple(layers)


def training_flops(
    config: ModelConfig | str,
    *,
    batch_size: int,
    seq_len: int,
    causal: bool = True,
    recompute: str = "none",
    flash_attention: bool = True,
) -> TrainingFlops:
    """FLOPs of one training step: forward (:func:`forward_layer_flops` + LM head 2ThV), backward = 2x
    forward, and recomputation: "full" repeats every layer's forward (not the LM head), "selective" repeats
    the attention core (QK^T and PV) only (Korthikanti et al. 2022, section 5), the forward work it executes;
    the paper's own hardware-FLOP count of it is three times that
    (:func:`korthikanti_selective_recompute_flops`). With ``flash_attention``
    the backward also recomputes S = QK^T (FlashAttention-2 paper, section 3.1.2: 5 backward matmuls instead
    of 4), counted in ``recompute_flops`` (hardware FLOPs), not in ``model_flops``.

    With ``causal=False`` on a GPT config (MHA, 4h non-gated MLP) this equals :func:`megatron_training_flops`
    exactly; ``causal=True`` counts only the pairs a causal kernel must compute.
    """
    config = resolve_model(config)
    _check_recompute(recompute)
    layers = forward_layer_flops(config, batch_size=batch_size, seq_len=seq_len, causal=causal)
    tokens = batch_size * seq_len
    lm_head = 2.0 * tokens * config.hidden_size * config.vocab_size
    layer_forward = sum(layer.total * layer.count for layer in layers)
    forward = layer_forward + lm_head
    backward = _BACKWARD_TO_FORWARD * forward
    if recompute == "full":
        extra = layer_forward
    elif recompute == "selective":
        extra = sum(layer.attention_core * layer.count for layer in layers)
    else:
        extra = 0.0
    if flash_attention:
        extra += sum(layer.attention_scores * layer.count for layer in layers)
    params = param_count(config)
    flop_params = params.active - (0 if config.tie_embeddings else params.embedding)
    return TrainingFlops(
        model=config.name,
        batch_size=batch_size,
        seq_len=seq_len,
        tokens=tokens,
        causal=causal,
        recompute=recompute,
        layers=layers,
        lm_head=lm_head,
        forward=forward,
        backward=backward,
        recompute_flops=extra,
        model_flops=forward + backward,
        hardware_flops=forward + backward + extra,
        six_nd=training_flops_6nd(flop_params, tokens),
    )


# --- activation memory ---


def korthikanti_activation_bytes_per_layer(
    *,
    seq_len: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes one transformer layer stores, Korthikanti et al. 2022, Table 2 (16-bit activations,
    GPT layer with dropout, 4h MLP, attention scores materialised), s = seq, b = micro-batch, h, a = heads,
    t = TP size:

    * no recomputation, TP without SP: sbh(10 + 24/t + 5as/(ht)); with SP: sbh(34/t + 5as/(ht))
      (t = 1 gives sbh(34 + 5as/h));
    * selective recomputation (attention core recomputed): sbh(10 + 24/t), with SP sbh(34/t);
    * full recomputation (only the layer input kept): 2sbh (Table 2); with SP that stored input is itself
      sequence-sharded, so 2sbh/t (our reading: Megatron checkpoints the SP-sharded layer input).
    """
    s, b, h, a, t = (
        positive_int(n, x)
        for n, x in (
            ("seq_len", seq_len),
            ("micro_batch_size", micro_batch_size),
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("tp", tp),
        )
    )
    _check_recompute(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sequence_parallel else 1)
    linear = 34.0 / t if sequence_parallel else 10.0 + 24.0 / t
    quadratic = 0.0 if recompute == "selective" else 5.0 * a * s / (h * t)
    return sbh * (linear + quadratic)


@dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes on the most loaded GPU (the first pipeline stage) for one training step."""

    per_layer_bytes: float  # one layer, one micro-batch, this GPU's share
    layers_per_stage: int
    microbatches_in_flight: float  # micro-batches whose activations the first stage holds at peak
    total_bytes: float


def activation_bytes_per_layer(
    config: ModelConfig | str,
    *,
    seq_len: int,
    micro_batch_size: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = True,
    dropout: bool = False,
    activation_bytes: int = 2,
    moe: bool | None = None,
) -> float:
    """Activation bytes one layer stores for backward, itemised as in Korthikanti et al. 2022, section 4.1,
    generalised to GQA/MLA, gated MLPs, MoE, FlashAttention and no dropout. With ``flash_attention=False,
    dropout=True`` on a GPT layer (MHA, 4h non-gated MLP) it equals sbh(34 + 5as/h) exactly.

    Items (e = bytes per activation, T = s*b tokens): 2 norm inputs 2*T*h*e; QKV input T*h*e; Q, K, V
    T*(H*d_qk + Hkv*d_qk + Hkv*d_v)*e (MLA: up-projected K/V stored, plus the latents); output-projection
    input T*H*d_v*e; attention: softmax output e*a*s*T + dropout mask a*s*T bytes + dropout output
    e*a*s*T (the last two only with dropout) without FlashAttention, or the fp32 log-sum-exp 4*a*T with it;
    MLP input T*h*e, gated: gate, up and activation output 3*T*I*e, plain: up and activation output 2*T*I*e;
    MoE: every routed copy stores its MLP items (k*T tokens) plus shared experts and fp32 router scores
    4*T*E; dropout masks T*h bytes after attention and after the MLP. TP splits everything except the norm
    inputs, the QKV and MLP inputs and the dropout masks (10sbh in the paper) unless sequence parallel.
    Selective recomputation drops the s^2 items; full recompute keeps only the layer input (2sbh, /t with SP).
    """
    config = resolve_model(config)
    s = positive_int("seq_len", seq_len)
    b = positive_int("micro_batch_size", micro_batch_size)
    t = positive_int("tp", tp)
    _check_recompute(recompute)
    e = activation_bytes
    tokens, h = s * b, config.hidden_size
    if recompute == "full":
        return tokens * h * e / (t if sequence_parallel else 1)
    heads, kv_heads = config.num_attention_heads, config.num_kv_heads
    qkv = heads * config.qk_head_dim + kv_heads * config.qk_head_dim + kv_heads * config.value_head_dim
    if config.uses_mla:
        qkv += config.kv_lora_rank + config.qk_rope_head_dim + config.q_lora_rank
    split = tokens * e * (qkv + heads * config.value_head_dim)
    replicated = 2 * tokens * h * e + tokens * h * e + tokens * h * e  # norm inputs, QKV input, MLP input
    if dropout:
        replicated += 2 * tokens * h  # two 1-byte masks
    if flash_attention:
        split += 4 * heads * tokens  # fp32 log-sum-exp per row and head
    elif recompute != "selective":
        split += heads * s * tokens * (e + (1 + e if dropout else 0))
    is_moe = config.is_moe if moe is None else moe
    gates = 3 if config.gated_mlp else 2
    if is_moe:
        routed_tokens = tokens * (config.experts_per_token + config.num_shared_experts)
        split += routed_tokens * gates * config.moe_intermediate_size * e
        split += routed_tokens * h * e  # each routed copy's input to its expert
        split += 4 * tokens * config.num_experts
    else:
        split += tokens * gates * config.intermediate_size * e
    if sequence_parallel:
        return (split + replicated) / t
    return split / t + replicated


def pipeline_stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers on each of ``pp`` pipeline stages, as even as possible: every stage gets floor(L/p) layers and
    the first L mod p stages one more (the last stage also carries the LM head, so it is the one to lighten).
    L = 61 (DeepSeek-V3) on 16 stages: 13 stages of 4 and 3 of 3. Raises ValueError if pp > L."""
    layers = positive_int("num_layers", num_layers)
    p = positive_int("pp", pp)
    if p > layers:
        raise ValueError(f"pp ({p}) must be at most num_layers ({layers}): every stage needs a layer")
    base, extra = divmod(layers, p)
    return tuple(base + (1 if stage < extra else 0) for stage in range(p))


def check_virtual_stages(config: ModelConfig, pp: int, virtual_stages: int) -> int:
    """``virtual_stages`` if each of the pp * virtual_stages model chunks of the interleaved schedule gets at
    least one of ``config``'s layers, else ValueError naming both: past that, half a layer per chunk would
    shrink the modelled bubble for a layout no framework can build."""
    v = positive_int("virtual_stages", virtual_stages)
    p = positive_int("pp", pp)
    if p * v > config.num_layers:
        raise ValueError(
            f"pp*virtual_stages ({p}*{v} = {p * v}) must be at most num_layers ({config.num_layers}) of "
            f"{config.name}: every model chunk needs a layer; valid virtual_stages for pp {p}: "
            f"1..{max(1, config.num_layers // p)}"
        )
    return v


def stage_layer_mix(config: ModelConfig, stage: int, pp: int) -> tuple[int, int]:
    """(dense layers, MoE layers) on pipeline ``stage`` of ``pp`` (:func:`pipeline_stage_layers`); an MoE
    model's leading ``first_dense_layers`` dense layers sit on the first stages."""
    counts = pipeline_stage_layers(config.num_layers, pp)
    first = sum(counts[:stage])
    dense = max(0, min(config.num_dense_layers, first + counts[stage]) - first)
    return dense, counts[stage] - dense


def microbatches_in_flight(
    schedule: str, pp: int, num_microbatches: int, *, virtual_stages: int = 1, stage: int = 0
) -> float:
    """Micro-batches whose activations pipeline ``stage`` (0-based) holds at its peak, in units of that
    stage's layers. GPipe: all m (every forward runs before any backward; Huang et al. 2019). 1F1B:
    min(m, p - stage), the forwards a stage runs before its first backward (Narayanan et al. 2021, section
    2.2). Interleaved with v virtual stages: stage 0 holds min(m, p) * (1 + (p-1)/(p*v)) (Korthikanti et al.
    2022, section 4.2.3); later stages are counted as under 1F1B."""
    p = positive_int("pp", pp)
    m = positive_int("num_microbatches", num_microbatches)
    v = positive_int("virtual_stages", virtual_stages)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1} for pp = {p}, got {stage!r}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and stage == 0:
        return min(m, p) * (1 + (p - 1) / (p * v))
    return float(min(m, p - stage))


def activation_memory(
    config: ModelConfig | str,
    *,
    seq_len: int,
    micro_batch_size: int,
    tp: int = 1,
    pp: int = 1,
    num_microbatches: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = True,
    dropout: bool = False,
) -> ActivationMemory:
    """Peak activation bytes on the first pipeline stage (Korthikanti et al. 2022, section 4.2.3).

    Each stage holds L/p layers (the first L mod p stages one more, :func:`pipeline_stage_layers`). GPipe
    keeps all m micro-batches in flight; 1F1B at most p (so the first stage holds L layers' worth, independent
    of p, when p divides L); the interleaved schedule multiplies 1F1B
    by (1 + (p-1)/(p*v)) for v virtual stages per GPU. Embedding and logit activations are not included.
    """
    config = resolve_model(config)
    p = positive_int("pp", pp)
    m = positive_int("num_microbatches", num_microbatches)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
    pipeline_stage_layers(config.num_layers, p)  # pp <= num_layers, named, before the chunks
    v = check_virtual_stages(config, p, virtual_stages)

    def layer_bytes(is_moe: bool) -> float:
        return activation_bytes_per_layer(
            config,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            tp=tp,
            sequence_parallel=sequence_parallel,
            recompute=recompute,
            flash_attention=flash_attention,
            dropout=dropout,
            moe=is_moe,
        )

    # The first stage holds the first layers: for MoE models with leading dense layers, its real mix.
    dense_here, moe_here = stage_layer_mix(config, 0, p)
    layers_per_stage = dense_here + moe_here
    stage_bytes = dense_here * layer_bytes(False) if dense_here else 0.0
    if moe_here:
        stage_bytes += moe_here * layer_bytes(True)
    in_flight = microbatches_in_flight(schedule, p, m, virtual_stages=v)
    per_layer = stage_bytes / layers_per_stage
    return ActivationMemory(
        per_layer_bytes=per_layer,
        layers_per_stage=layers_per_stage,
        microbatches_in_flight=in_flight,
        total_bytes=stage_bytes * in_flight,
    )
