"""Attention: naive (score matrix in memory), tiled (two passes over K), FlashAttention (online softmax),
FlashAttention over packed variable-length sequences, and decoding against a KV cache.

All share one semantics; ``reference.reference_attention`` is the plain PyTorch spec. ``flash.py`` holds the
Triton kernels of the dense and packed ops and their launcher; ``checks.py`` the argument checks they share.
"""

from .checks import validate_attention_inputs
from .decode import flash_attention_with_kvcache
from .flash import flash_attention
from .naive import naive_attention
from .tiled import tiled_attention
from .varlen import flash_attention_varlen

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "naive_attention",
    "tiled_attention",
    "validate_attention_inputs",
]
