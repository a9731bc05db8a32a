"""The context-parallel cost model, the ring-plan command and the one-rank ring (all in-process, no spawn)."""

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from llm_speed import flash_attention
from llm_speed.attention import flash
from llm_speed.cli import main
from llm_speed.core import runtime
from llm_speed.core.sequence_split import sequence_chunk_lengths, shard_lengths
from llm_speed.distributed import (
    clear_sent_messages,
    gather_sequence,
    ring_attention,
    sent_messages,
    shard_sequence,
)
from llm_speed.perf.context_parallel import ring_attention_plan, ring_bytes_per_rank
from llm_speed.perf.distributed import context_parallel_kv_bytes_per_layer, link_bandwidth
from llm_speed.perf.models import get_model


def test_split_follows_tensor_split():
    assert sequence_chunk_lengths(13, 2, "zigzag") == [4, 3, 3, 3]
    assert shard_lengths(13, 2, "zigzag") == [7, 6]  # chunks (0, 3) and (1, 2)
    assert shard_lengths(19, 4, "zigzag") == [5, 5, 5, 4]
    assert shard_lengths(10, 4, "contiguous") == [3, 3, 2, 2]
    assert [len(c) for c in torch.arange(13).tensor_split(4)] == sequence_chunk_lengths(13, 2, "zigzag")
    with pytest.raises(ValueError, match="at least 8"):
        shard_lengths(7, 4, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_lengths(8, 2, "striped")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_forward_bytes_are_the_perf_models(cp, layout):
    config = get_model("llama-3-8b")
    seq = 8192
    sends = ring_bytes_per_rank(
        batch=2, heads_kv=config.num_kv_heads, seq_len=seq, head_dim=config.head_dim, world=cp, layout=layout,
        dtype="bf16",
    )  # fmt: skip
    expected = context_parallel_kv_bytes_per_layer(config, seq_len=seq, micro_batch_size=2, cp=cp)
    step = 2 * 2 * config.num_kv_heads * config.head_dim * (seq // cp) * 2
    for rank_sends in sends:
        assert sum(rank_sends["forward_kv"]) == expected
        assert rank_sends["forward_kv"] == rank_sends["backward_kv"] == [step] * (cp - 1)
        assert rank_sends["backward_dkv"] == [2 * step] * cp  # float32 accumulators of bf16 K/V


def test_plan_hides_long_blocks_not_short_ones():
    long = ring_attention_plan("llama-3-8b", seq_len=131072, cp=8, gpu="h100-sxm")
    assert long.tokens_per_rank == 16384 and long.forward_steps == 7
    assert long.forward_bytes_per_layer == 7 * long.kv_bytes_per_step
    assert long.backward_bytes_per_layer == 7 * long.kv_bytes_per_step + 8 * long.dkv_bytes_per_step
    assert long.forward_transfer_s == pytest.approx(long.kv_bytes_per_step / link_bandwidth("h100-sxm"))
    assert long.forward_hidden and long.backward_hidden
    assert long.forward_bytes_per_rank == 32 * long.forward_bytes_per_layer
    # Compute grows with the square of the shard, the transfer linearly: short shards over PCIe do not hide.
    short = ring_attention_plan("llama-3-8b", seq_len=16384, cp=8, gpu="h100-pcie", link="pcie")
    assert not short.forward_hidden and short.forward_transfer_s > short.forward_block_s
    # Zigzag gives each causal step half a block; contiguous leaves the busiest rank a full one.
    contiguous = ring_attention_plan("llama-3-8b", seq_len=131072, cp=8, gpu="h100-sxm", layout="contiguous")
    assert contiguous.forward_block_flops == 2 * long.forward_block_flops
    alone = ring_attention_plan("llama-3-8b", seq_len=4096, cp=1, gpu="h100-sxm")
    assert alone.forward_bytes_per_layer == alone.backward_bytes_per_layer == 0 and alone.forward_hidden


def test_uneven_shards_price_the_longest_chunks_a_rank_meets():
    """100 tokens on 8 ranks, zigzag: chunks 0-3 have 7 tokens, the rest 6; rank 3 (chunks 3 and 12: 13
    tokens) meets rank 0's first chunk (7) with all its queries: 91 query-key pairs, where 13 x (13 // 2) =
    78 were priced. Contiguous causal: only earlier ranks' shards, whole; the latency is in the plan."""
    config = get_model("llama-3-8b")
    per_pair = 4 * config.num_attention_heads * config.head_dim
    zigzag = ring_attention_plan("llama-3-8b", seq_len=100, cp=8, gpu="h100-sxm", latency_s=1e-5)
    assert zigzag.forward_block_flops == per_pair * 13 * 7
    assert zigzag.latency_s == 1e-5 and zigzag.forward_transfer_s == pytest.approx(
        1e-5 + zigzag.kv_bytes_per_step / zigzag.link_bytes_per_s)  # fmt: skip
    contiguous = ring_attention_plan("llama-3-8b", seq_len=100, cp=8, gpu="h100-sxm", layout="contiguous")
    assert contiguous.forward_block_flops == per_pair * 13 * 13  # ranks 0-3 hold 13, rank 1 meets rank 0
    uneven = ring_attention_plan("llama-3-8b", seq_len=99, cp=8, gpu="h100-sxm", layout="contiguous")
    assert uneven.forward_block_flops == per_pair * 13 * 13  # 99 = 3 x 13 + 5 x 12: ranks 1, 2 meet 0
    lone = ring_attention_plan("llama-3-8b", seq_len=97, cp=8, gpu="h100-sxm", layout="contiguous")
    assert lone.forward_block_flops == per_pair * 12 * 13  # 97: only rank 0 holds 13; rank 1 holds 12


def test_plan_bad_input():
    with pytest.raises(ValueError, match="MLA"):
        ring_attention_plan("deepseek-v3", seq_len=4096, cp=2, gpu="h100-sxm")
    with pytest.raises(ValueError, match="no NVLink"):
        ring_attention_plan("llama-3-8b", seq_len=4096, cp=2, gpu="l40s")
    with pytest.raises(TypeError, match="cp must be an int"):
        ring_attention_plan("llama-3-8b", seq_len=4096, cp=2.0, gpu="h100-sxm")
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_attention_plan("llama-3-8b", seq_len=4096, cp=2, gpu="h100-sxm", causal=1)
    with pytest.raises(ValueError, match="latency_s"):
        ring_attention_plan("llama-3-8b", seq_len=4096, cp=2, gpu="h100-sxm", latency_s=-1)


def test_ring_plan_command(capsys):
    argv = [
        "ring-plan",
        "--model",
        "llama-3-8b",
        "--seq-len",
        "131072",
        "--world-size",
        "8",
        "--gpu",
        "h100-sxm",
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "forward" in table and "7 K/V + 8 dK/dV" in table
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["kv_bytes_per_step"] == 2 * 8 * 128 * 16384 * 2 and payload["forward_hidden"] is True
    assert main([*argv[:-1], "l4"]) == 2
    assert "no NVLink" in capsys.readouterr().err
    # the dtypes the ring's flash kernels take, as its help says (fp8 and fp64 were planned without a word)
    for dtype in ("fp8", "fp64"):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--dtype", dtype])
        assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.fixture
def one_rank_group():
    """A gloo group of one process (this one), torn down afterwards."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_is_flash_exactly(one_rank_group, device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 11, 16, device=device, requires_grad=True) for _ in range(3))
    before = runtime.launch_counts()
    clear_sent_messages()
    out = ring_attention(q, k[:, :2], v[:, :2], group=one_rank_group, is_causal=True)
    out.sum().backward()
    ring_grads = [t.grad.clone() for t in (q, k, v)]
    ran = runtime.launch_counts() - before
    if runtime.triton_runs_on(device):
        assert ran[flash.FORWARD.name] == 1
        assert all(ran[kernel.name] == 1 for kernel in flash.default_backward_kernels(device)), ran
    for t in (q, k, v):
        t.grad = None
    expected = flash_attention(q, k[:, :2], v[:, :2], is_causal=True)
    expected.sum().backward()
    assert torch.equal(out, expected)
    for got, t in zip(ring_grads, (q, k, v), strict=True):
        assert torch.equal(got, t.grad)
    assert sent_messages() == []  # nothing to send on one rank
    numpy = pytest.importorskip("numpy", reason="needs numpy (a dependency of llm-speed)")
    again = ring_attention(q, k[:, :2], v[:, :2], is_causal=numpy.bool_(True), return_lse=numpy.bool_(False))
    assert torch.equal(again, out)
    # A [batch, seq, heads, dim] tensor viewed as [batch, heads, seq, dim] is read in place.
    packed = torch.randn(1, 11, 4, 16, device=device).transpose(1, 2)
    torch.testing.assert_close(
        ring_attention(packed, packed, packed), flash_attention(packed, packed, packed)
    )
    empty = ring_attention(q[:0], k[:0], v[:0], is_causal=True)
    assert empty.shape == (0, 4, 11, 16)
    x = torch.randn(2, 3, 9, 4)
    assert torch.equal(gather_sequence(shard_sequence(x, dim=2), dim=-2), x)
    with pytest.raises(TypeError, match="group must be"):
        ring_attention(q, k, v, group="world")
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(x, layout="ring")
