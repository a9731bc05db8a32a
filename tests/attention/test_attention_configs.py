"""Every shipped attention block configuration run directly, on ragged shapes with far more blocks than SMs
(GPU), into NaN-poisoned outputs, forward and backward, against float64 with the 2x/3x rule.

The launchers pick one configuration per (direction, dtype class, head dim) for the device at hand; the
others (another tier's) would otherwise never run. On the CPU the interpreter ignores warps and stages, so
each block shape runs once.
"""

import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    check_against_reference,
    expect_launches,
    pin_configs,
)

from llm_speed import flash_attention
from llm_speed.attention import flash
from llm_speed.core import runtime
from llm_speed.core.hardware import hardware_of

BLOCKS_PER_SM = 4  # on a GPU: at least this many programs per SM


def _to_run():
    shipped = flash.shipped_configs()
    if not runtime.INTERPRETED:
        return shipped
    unique = {}
    for entry in shipped:
        key = (entry.direction, entry.dtype, entry.block_d, entry.config.block_m, entry.config.block_n)
        unique.setdefault(key, entry)
    return tuple(unique.values())


def _id(entry):
    tier = entry.tier.replace(" ", "")
    return f"{tier}-{entry.direction}-{str(entry.dtype)[6:]}-d{entry.block_d}-{entry.config.name()}"


@pytest.mark.parametrize("entry", _to_run(), ids=_id)
def test_each_shipped_config_directly(monkeypatch, device, entry):
    config = entry.config
    pin_configs(monkeypatch, **{entry.direction: config})
    # The 16-bit row serves bfloat16 too: the GPU runs bf16 with it (the interpreter widens bf16 dots).
    dtype = entry.dtype if entry.dtype == torch.float32 or device.type != "cuda" else torch.bfloat16
    head_dim = entry.block_d - 8  # pads to block_d: masked head-dim columns
    blocks = max(config.block_m, config.block_n)
    if device.type == "cuda":
        batch, heads_q, heads_kv = 4, 12, 4
        per_head = -(-BLOCKS_PER_SM * hardware_of(device).sm_count // (batch * heads_q))
        seq_q, seq_kv = per_head * blocks + 3, per_head * blocks + 11
    else:
        batch, heads_q, heads_kv = 1, 2, 1
        seq_q, seq_kv = blocks + 3, blocks + 21  # ragged: a partial last block of queries and of keys
    q = torch.randn(batch, heads_q, seq_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, seq_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, heads_kv, seq_kv, head_dim, device=device, dtype=dtype)
    grads = entry.direction == "backward"
    with expect_launches(*(BACKWARD_KERNELS if grads else FORWARD_KERNELS), device=device):
        check_against_reference(
            flash_attention, q, k, v, is_causal=True, grads=grads, reference_device=device
        )
