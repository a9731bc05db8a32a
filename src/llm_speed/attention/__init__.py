"""Attention: naive (score matrix in memory), tiled (two passes over K), FlashAttention (online softmax).

All three share one signature and semantics; ``reference.reference_attention`` is the plain PyTorch spec.
"""

from .decode import flash_attention_with_kvcache
from .flash import flash_attention
from .naive import naive_attention
from .tiled import tiled_attention
from .validation import validate_attention_inputs

__all__ = [
    "flash_attention",
    "flash_attention_with_kvcache",
    "naive_attention",
    "tiled_attention",
    "validate_attention_inputs",
]
