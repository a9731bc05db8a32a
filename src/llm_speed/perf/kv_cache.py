"""KV-cache size for MHA, MQA, GQA, MLA and sliding-window attention, in any storage dtype.

Per token and layer the cache holds (elements):

* MHA / MQA / GQA: ``2 * num_kv_heads * head_dim`` (one K and one V vector per KV head). MHA has
  num_kv_heads = num_heads; MQA 1 (1/num_heads of MHA); GQA g groups (g/num_heads of MHA): per layer,
  KV cache = 2 * n_heads * d_k * seq_len * batch_size elements for MHA (Ainslie et al., "GQA", 2023).
* MLA (DeepSeek-V2 paper, arXiv:2405.04434, Table 1): ``kv_lora_rank + qk_rope_head_dim`` — the compressed
  latent c_KV and the decoupled RoPE key shared by all heads (DeepSeek-V3: 512 + 64 = 576).
* Sliding window (Mistral 7B, arXiv:2310.06825, "rolling buffer cache"): at most ``sliding_window`` tokens
  per sequence are kept, so the cache stops growing at the window.

Quantized caches (fp8/int8: 1 byte, int4: 0.5 byte per element) also store scale factors, whose overhead
depends on the scheme: pass ``quant_group_size`` (elements sharing one scale, e.g. 32 or 64 for group-wise
int4, ``head_dim`` for one scale per token and head) and ``scale_bytes`` (2 for one fp16 scale; 4 for an
fp16 scale plus an fp16 zero point). Per-tensor scales (vLLM's default fp8 cache) are negligible: leave
``quant_group_size`` unset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.perf.models import ModelConfig, resolve_model


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache of ``batch_size`` sequences of ``seq_len`` tokens; ``cached_tokens`` is what one sequence
    keeps (``seq_len`` capped at the sliding window)."""

    model: str
    attention_type: str
    dtype: str
    seq_len: int
    batch_size: int
    cached_tokens: int
    elements_per_token_per_layer: int
    scale_bytes_per_token_per_layer: float  # ceil(elements / quant_group_size) * scale_bytes
    bytes_per_token_per_layer: float  # elements * element size + the scales
    bytes_per_token: float
    bytes_per_sequence: float
    total_bytes: float


def kv_elements_per_token_per_layer(config: ModelConfig) -> int:
    """Cached elements per token per layer: 2*Hkv*d (MHA/MQA/GQA) or kv_lora_rank + qk_rope_head_dim (MLA)."""
    if config.uses_mla:
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.num_kv_heads * config.head_dim


def kv_cache_size(
    config: ModelConfig | str,
    *,
    seq_len: int,
    batch_size: int = 1,
    dtype: str = "bf16",
    quant_group_size: int | None = None,
    scale_bytes: float = 2,
) -> KVCacheSize:
    """Bytes of the KV cache: per token per layer, per token (all layers), per sequence and in total.

    total = batch_size * min(seq_len, sliding_window) * num_layers * per_token_layer, with per_token_layer =
    elements * bytes(dtype) + ceil(elements / quant_group_size) * scale_bytes (no scales when
    ``quant_group_size`` is None; see the module docstring). ``config`` may be a ModelConfig, a zoo id or a
    config.json path; ``dtype`` any name :func:`llm_speed.core.gpus.normalize_dtype` accepts (bf16, fp16,
    fp32, fp8, int8, int4, ...).
    """
    config = resolve_model(config)
    positive_int("seq_len", seq_len)
    positive_int("batch_size", batch_size)
    dtype_name = normalize_dtype(dtype)
    elements = kv_elements_per_token_per_layer(config)
    scales = 0.0
    if quant_group_size is not None:
        group = positive_int("quant_group_size", quant_group_size)
        scales = math.ceil(elements / group) * non_negative_number("scale_bytes", scale_bytes)
    per_token_layer = elements * dtype_bytes(dtype_name) + scales
    per_token = per_token_layer * config.num_layers
    cached = min(seq_len, config.sliding_window) if config.sliding_window else seq_len
    per_sequence = per_token * cached
    return KVCacheSize(
        model=config.name,
        attention_type=config.attention_type,
        dtype=dtype_name,
        seq_len=seq_len,
        batch_size=batch_size,
        cached_tokens=cached,
        elements_per_token_per_layer=elements,
        scale_bytes_per_token_per_layer=scales,
        bytes_per_token_per_layer=per_token_layer,
        bytes_per_token=per_token,
        bytes_per_sequence=per_sequence,
        total_bytes=per_sequence * batch_size,
    )


def max_batch_for_memory(
    config: ModelConfig | str, *, seq_len: int, free_bytes: float, dtype: str = "bf16"
) -> int:
    """The largest batch whose KV cache at ``seq_len`` fits in ``free_bytes``: floor(free / per sequence)."""
    free_bytes = non_negative_number("free_bytes", free_bytes)
    per_sequence = kv_cache_size(config, seq_len=seq_len, batch_size=1, dtype=dtype).bytes_per_sequence
    return int(free_bytes // per_sequence)
