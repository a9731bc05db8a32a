"""Context parallelism: ring attention over ``torch.distributed`` and the sequence shard/gather helpers.

Importing this package needs no GPU and no initialised process group; the functions check for one.
"""

from llm_speed.distributed.layout import LAYOUTS, gather_sequence, shard_sequence
from llm_speed.distributed.ring import SentMessage, clear_sent_messages, ring_attention, sent_messages

__all__ = [
    "LAYOUTS",
    "SentMessage",
    "clear_sent_messages",
    "gather_sequence",
    "ring_attention",
    "sent_messages",
    "shard_sequence",
]
