"""Model and hardware FLOP utilisation from a measured time.

MFU = (model FLOPs / measured seconds) / peak FLOP/s, where model FLOPs count only the work the algorithm
needs (e.g. 2mnk for a GEMM, causal attention's visible pairs). HFU uses the FLOPs the hardware actually
executed, including recomputation (activation checkpointing, FlashAttention's backward recomputing QK^T)
and any masked work done anyway. Definitions: Chowdhery et al., "PaLM" (2022), Appendix B; Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models" (2022). Worked example: a 4096^3 GEMM
(137.4 GFLOP) in 0.5 ms on H100 SXM: 274.9 TFLOP/s achieved, MFU 27.8% of the 989.4 TFLOP/s dense bf16
peak.

Training MFU from a throughput depends on how the FLOPs per token are counted; published figures use
different conventions (:data:`MFU_CONVENTIONS`, :func:`training_flops_per_token`):

* ``causal`` / ``non_causal``: this library's count (:func:`llm_speed.perf.training.training_flops`),
  attention over the causal pairs only, or over all s x s pairs as the papers below count it. At 2k tokens
  the difference is a few percent; at 64k tokens it is a third of the FLOPs.
* ``megatron``: Narayanan et al. 2021, eq. 3 without recomputation, per token:
  72 l h^2 (1 + s/(6h) + V/(12 l h)) (GPT: MHA, 4h MLP; non-causal). The Megatron formulas are published
  for dense GPT models only: for a mixture-of-experts config they do not apply (its MLP is not a dense 4h
  MLP; Mixtral-8x7B would read 45% low), so :func:`training_flops_per_token` raises ValueError and
  :func:`convention_not_applicable` gives the reason (``llm-speed mfu`` reports them as not applicable).
* ``megatron_hfu_selective``: Korthikanti et al. 2022, section 6, hardware FLOPs with selective
  recomputation: 72 l h^2 (1 + s/(3h) + V/(12 l h)). ``megatron_hfu_full``: with full recomputation,
  96 l h^2 (1 + s/(6h) + V/(16 l h)).
* ``mosaicml``: llm-foundry's scripts/train/benchmarking/README.md: 6 N + 12 l h s (N the parameters a
  token computes with: all of them for a dense model, the active ones for a mixture of experts, as
  llm-foundry's MPT ``flops_per_batch`` uses ``n_active_params``; non-causal attention; 3 network passes).
  ``mosaicml_hfu``: 8 N + 16 l h s (activation checkpointing). Mixtral-8x7B at 4k: 6 x 12.9B active +
  attention = 83.7 GFLOP/token, within 1% of the exact non-causal count (6 x 46.7B total would read 3.5x
  too high).
"""

from __future__ import annotations

from typing import Any

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.core.gpus import GPUSpec, get_gpu
from llm_speed.perf.models import ModelConfig, param_count, resolve_model

MFU_CONVENTIONS = (
    "causal",
    "non_causal",
    "megatron",
    "megatron_hfu_selective",
    "megatron_hfu_full",
    "mosaicml",
    "mosaicml_hfu",
)

_DENSE_ONLY_CONVENTIONS = ("megatron", "megatron_hfu_selective", "megatron_hfu_full")


def convention_not_applicable(config: ModelConfig | str, convention: str) -> str | None:
    """Why ``convention`` cannot count ``config``'s FLOPs, or None when it can. The Megatron formulas
    (:data:`MFU_CONVENTIONS`) assume a dense GPT layer (MHA and a 4h MLP); a mixture-of-experts layer computes
    with ``experts_per_token`` (+ shared) experts of another width, which they have no term for."""
    config = resolve_model(config)
    if convention in _DENSE_ONLY_CONVENTIONS and config.is_moe:
        return (
            f"{convention}: the Megatron formula is for dense GPT models (4h MLP); {config.name} is a "
            f"mixture of experts ({config.experts_per_token} of {config.num_experts} experts per token)"
        )
    return None


def achieved_flops_per_s(flops: float, seconds: float) -> float:
    """``flops / seconds``; raises ValueError for negative FLOPs or a non-positive time."""
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
        raise ValueError(f"flops must be a number >= 0, got {flops!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
    return flops / seconds


def mfu(flops: float, seconds: float, gpu: str | GPUSpec, dtype: Any) -> float:
    """Model FLOP utilisation in [0, 1] (can exceed 1 only if the inputs are wrong): achieved / dense peak.

    ``flops`` are the model's useful FLOPs, ``seconds`` the measured wall time, the peak is
    ``get_gpu(gpu).peak_flops(dtype)`` (dense, never sparse).
    """
    return achieved_flops_per_s(flops, seconds) / get_gpu(gpu).peak_flops(dtype)


def hfu(hardware_flops: float, seconds: float, gpu: str | GPUSpec, dtype: Any) -> float:
    """Hardware FLOP utilisation: executed FLOPs (incl. recomputation) / seconds / dense peak; HFU >= MFU."""
    return achieved_flops_per_s(hardware_flops, seconds) / get_gpu(gpu).peak_flops(dtype)


def training_flops_per_token(
    config: ModelConfig | str, seq_len: int, convention: str = "non_causal"
) -> float:
    """Training FLOPs (forward + backward, + recomputation for the HFU conventions) per token of sequences
    of ``seq_len`` tokens, counted under ``convention`` (one of :data:`MFU_CONVENTIONS`; see the module
    docstring). The Megatron formulas use the config's hidden size h, layers l and vocabulary V only, and
    raise ValueError for a mixture-of-experts config (:func:`convention_not_applicable`); the MosaicML ones
    count its active parameters."""
    from llm_speed.perf.training import training_flops

    config = resolve_model(config)
    s = positive_int("seq_len", seq_len)
    if convention not in MFU_CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(MFU_CONVENTIONS)}, got {convention!r}")
    reason = convention_not_applicable(config, convention)
    if reason is not None:
        raise ValueError(reason)
    h, layers, vocab = config.hidden_size, config.num_layers, config.vocab_size
    if convention in ("causal", "non_causal"):
        counted = training_flops(
            config, batch_size=1, seq_len=s, causal=convention == "causal", flash_attention=False
        )
        return counted.model_flops / s
    if convention == "megatron":
        return 72.0 * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    if convention == "megatron_hfu_selective":
        return 72.0 * layers * h * h * (1 + s / (3 * h) + vocab / (12 * layers * h))
    if convention == "megatron_hfu_full":
        return 96.0 * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))
    passes = 3 if convention == "mosaicml" else 4
    # N: the parameters each token computes with (total for a dense model, active for a mixture of experts).
    return passes * (2.0 * param_count(config).active + 4.0 * layers * h * s)


def throughput_mfu(
    config: ModelConfig | str,
    tokens_per_second: float,
    gpu: str | GPUSpec,
    *,
    seq_len: int,
    num_gpus: int = 1,
    dtype: Any = "bf16",
    convention: str = "non_causal",
) -> float:
    """Training MFU (or HFU, for the ``*_hfu*`` conventions) from a measured throughput:
    ``training_flops_per_token * tokens_per_second / (num_gpus * dense peak)``; ``tokens_per_second`` is the
    total over ``num_gpus`` GPUs. Raises ValueError where the convention does not apply to ``config``
    (:func:`convention_not_applicable`)."""
    rate = non_negative_number("tokens_per_second", tokens_per_second)
    gpus = positive_int("num_gpus", num_gpus)
    per_token = training_flops_per_token(config, seq_len, convention)
    return per_token * rate / (gpus * get_gpu(gpu).peak_flops(dtype))
