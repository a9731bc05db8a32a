"""Context parallelism: ring attention over ``torch.distributed`` and the sequence shard/gather helpers.

Importing this package needs no GPU and no initialised process group; the functions check for one. Names
load from their modules on first use (PEP 562), so the ``ring-plan`` command starts without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LAYOUTS": "llm_speed.distributed.layout",
    "gather_sequence": "llm_speed.distributed.layout",
    "shard_sequence": "llm_speed.distributed.layout",
    "SentMessage": "llm_speed.distributed.ring",
    "clear_sent_messages": "llm_speed.distributed.ring",
    "ring_attention": "llm_speed.distributed.ring",
    "sent_messages": "llm_speed.distributed.ring",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llm_speed.distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
