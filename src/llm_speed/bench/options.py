"""The vocabulary of ``llm-speed bench``: implementations, modes, dtypes, layouts and epilogues.

Torch-free, so the command-line parser is built without importing torch. The implementations come from the
op table (:mod:`llm_speed.ops`): llm-speed's own (``bench_name`` of each row) and what each is compared with
(its ``alternatives``).
"""

from __future__ import annotations

from llm_speed import ops
from llm_speed.perf.kernel_costs import ATTENTION_MODES

# The most timed runs of one measurement, whatever min_time_s asks (a workload of microseconds would
# otherwise run millions of times); also the most runs --warmup and --iterations take.
MAX_ITERATIONS = 10_000

# --- bench attention ---
ATTENTION_LLM_SPEED_IMPLS = ops.bench_names("attention")  # flash, tiled, naive
ATTENTION_IMPLS = ops.bench_impls("attention")  # ... then sdpa (each backend) and flash_attn
# Each benchmark's Triton implementations: the timing notes say what their times mean off a GPU.
ATTENTION_FP8_IMPL = ops.get("flash_attention_fp8").bench_name  # flash-fp8: e4m3 inputs, forward only
ATTENTION_TRITON_IMPLS = ("flash", ATTENTION_FP8_IMPL, "tiled")
ATTENTION_DTYPES = ("fp16", "bf16", "fp32")
ATTENTION_MODES = ATTENTION_MODES  # fwd, bwd, fwd+bwd (the cost model's modes)

# --- bench decode ---
# dense cache, paged cache (in --dtype), the same over an fp8 (e4m3) cache, SDPA over a dense cache
DECODE_IMPLS = ("kvcache", "kvcache-paged", "kvcache-fp8", "kvcache-paged-fp8", "sdpa")
DECODE_TRITON_IMPLS = ("kvcache", "kvcache-paged", "kvcache-fp8", "kvcache-paged-fp8")
# each fp8-cache implementation and the 16-bit one it is compared with (tokens/s ratio)
DECODE_FP8_IMPLS = {"kvcache-fp8": "kvcache", "kvcache-paged-fp8": "kvcache-paged"}
DECODE_DTYPES = ("fp16", "bf16", "fp32")

# --- bench ops, bench train-step ---
OPS_IMPLS = ("llm_speed", "eager", "torch.compile", "liger")  # liger: Liger-Kernel, when installed
OPS_TRITON_IMPLS = ("llm_speed", "liger")  # also train-step's variants
OPS_NAMES = ("rms_norm", "swiglu", "rotary", "linear_cross_entropy")
OPS_DTYPES = ("bf16", "fp16", "fp32")
# unpatched; patched by integrations.transformers.apply; patched by Liger-Kernel's apply_liger_kernel_to_llama
TRAIN_STEP_VARIANTS = ("transformers", "llm_speed", "liger")
# the families llm_speed.integrations.transformers patches (bench.train_step.FAMILIES holds their configs)
TRAIN_STEP_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma",
                       "gemma2", "gemma3_text", "phi3", "olmo2", "granite", "deepseek_v3")  # fmt: skip

# --- bench gemm ---
GEMM_DTYPES = ("fp16", "bf16", "fp32", "int8", "fp8")
# fp8: every case runs at each scaling granularity (gemm_fp8 reads it from the scale shapes)
GEMM_FP8_GRANULARITIES = ("tensor", "row", "block")
GEMM_LAYOUTS = ("NN", "NT", "TN", "TT")  # first letter: A stored transposed (T) or not; second: B
ACTIVATION_NAMES = ("relu", "gelu", "gelu_tanh", "silu")
GEMM_EPILOGUES = ("none", "bias", *(f"bias+{name}" for name in ACTIVATION_NAMES))
GEMM_IMPLS = ops.bench_impls("gemm")  # llm-speed, torch, torch-int-mm
GEMM_TRITON_IMPLS = ("llm-speed",)
_FLOAT_ROW, _INT8_ROW, _FP8_ROW = ops.get("gemm"), ops.get("tensor_core_gemm_int8"), ops.get("gemm_fp8")
GEMM_FLOAT_IMPLS = (_FLOAT_ROW.bench_name, *_FLOAT_ROW.alternatives)  # llm-speed, torch
GEMM_INT8_IMPLS = (_INT8_ROW.bench_name, *_INT8_ROW.alternatives)  # llm-speed, torch-int-mm
# llm-speed (gemm_fp8), torch-scaled-mm (the same scaling), torch (bf16 torch.matmul of the same values)
GEMM_FP8_IMPLS = (_FP8_ROW.bench_name, *_FP8_ROW.alternatives)

# --- bench moe ---
MOE_IMPLS = ("llm_speed", "grouped_mm", "hf-loop")  # fused_moe; torch._grouped_mm in PyTorch; HF's loop
MOE_TRITON_IMPLS = ("llm_speed",)
MOE_DTYPES = ("bf16", "fp16", "fp32")
MOE_MODES = ("fwd", "fwd+bwd")

# --- bench overhead ---
OVERHEAD_OPS = ("flash_attention", "tiled_attention", "naive_attention", "flash_attention_varlen",
                "flash_attention_with_kvcache", "gemm", "tensor_core_gemm_int8", "rms_norm", "swiglu",
                "apply_rotary", "fused_linear_cross_entropy", "flash_attn_func", "flash_attn_varlen_func",
                "flash_attn_with_kvcache")  # fmt: skip
OVERHEAD_MODES = ("inference", "autograd", "training")
