"""GPU-scale KV-cache decode (contexts 1k-16k, head_dim 64/128, fp16/bf16, dense and paged), CUDA only.

Every sequence is checked against float64 with the 2x rule against PyTorch SDPA in the same dtype over the
same dense keys (one query row per head: SDPA without is_causal sees every key, as decode does).
"""

import pytest
import torch
from attention_testing import ERROR_CAP, max_error

from llm_speed import flash_attention_with_kvcache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICE = "cuda"


@pytest.mark.parametrize("context", [1024, 16384])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("batch", [1, 32])
def test_decode_against_float64_and_sdpa(context, head_dim, dtype, page_size, batch):
    heads_q, heads_kv = 32, 8
    lens = torch.randint(context // 2, context, (batch,), dtype=torch.int32, device=DEVICE)
    lens[0] = context - 1  # one sequence fills the cache after the append
    keys = torch.randn(batch, context, heads_kv, head_dim, device=DEVICE, dtype=dtype)
    values = torch.randn_like(keys)
    q = torch.randn(batch, 1, heads_q, head_dim, device=DEVICE, dtype=dtype)
    k_new, v_new = (
        keys[torch.arange(batch), lens.long()][:, None],
        values[torch.arange(batch), lens.long()][:, None],
    )
    if page_size is None:
        k_cache, v_cache, table = keys.clone(), values.clone(), None
    else:
        pages = context // page_size
        table = torch.randperm(batch * pages, device=DEVICE).to(torch.int32).reshape(batch, pages)
        k_cache = torch.empty(batch * pages, page_size, heads_kv, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.empty_like(k_cache)
        k_cache[table.flatten().long()] = keys.reshape(batch * pages, page_size, heads_kv, head_dim)
        v_cache[table.flatten().long()] = values.reshape(batch * pages, page_size, heads_kv, head_dim)
    out = flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lens, k=k_new, v=v_new, block_table=table
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b in range(batch):
        n = int(lens[b]) + 1
        k_b, v_b = keys[b, :n].transpose(0, 1)[None], values[b, :n].transpose(0, 1)[None]
        q_b = q[b].transpose(0, 1)[None]
        truth = sdpa(q_b.double(), k_b.double(), v_b.double(), enable_gqa=True)
        same = sdpa(q_b, k_b, v_b, enable_gqa=True)
        err, err_sdpa = max_error(out[b].transpose(0, 1)[None], truth), max_error(same, truth)
        assert err <= 2 * err_sdpa + ERROR_CAP[dtype], (b, err, err_sdpa)


def _paged_step(batch=4, heads_q=8, heads_kv=2, dim=128, page=16, pages=64, dtype=torch.float16):
    """A paged decode step with a one-token append, its inputs, and a function that runs it."""
    num_blocks = batch * pages
    k_cache = torch.randn(num_blocks, page, heads_kv, dim, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).reshape(batch, pages)
    lens = torch.tensor([5, 300, 1000, 17][:batch], dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, 1, heads_q, dim, device=DEVICE, dtype=dtype)
    k_new, v_new = (torch.randn(batch, 1, heads_kv, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    inputs = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lens, k=k_new, v=v_new, block_table=table
    )

    def step(**override):
        call = {**inputs, **override}
        return flash_attention_with_kvcache(
            call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), return_lse=True, **call
        )

    return inputs, step


def test_default_path_never_synchronises():
    """CUDA tensors skip the value checks: a call (after its first, which compiles) makes no host sync."""
    _, step = _paged_step()
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out).all()


def test_cuda_graph_replays_with_new_lengths_and_pages():
    """One captured step replays with new cache_seqlens values and block-table contents, bitwise as eager
    calls of the same shapes."""
    inputs, step = _paged_step()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()  # compile and make the plans outside the capture
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_lse = step()
    for lens in ([0, 999, 12, 640], [63, 1, 1022, 200]):
        inputs["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        inputs["block_table"].copy_(inputs["block_table"].flip(1))
        caches = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        graph.replay()
        eager_out, eager_lse = step(k_cache=caches[0], v_cache=caches[1])
        torch.cuda.synchronize()
        assert torch.equal(captured_out, eager_out) and torch.equal(captured_lse, eager_lse)
        assert torch.equal(inputs["k_cache"], caches[0]) and torch.equal(inputs["v_cache"], caches[1])


def test_new_tokens_whose_rows_pass_2_31_elements_land_in_their_cache_rows():
    """The append reads the new keys' rows at j * stride: in 32 bits that wrapped once a row passed 2^31
    elements (a prefill's keys as a view of a fused QKV projection, ~210k tokens at 64 + 2 x 8 heads of 128),
    writing other memory's rows into the cache. Rows 2^30 elements apart, three of them: 4 GiB a tensor."""
    heads_kv, dim, new, stride = 2, 64, 3, 2**30
    dtype = torch.bfloat16
    k_cache = torch.zeros(1, 16, heads_kv, dim, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    shape, strides = (1, new, heads_kv, dim), ((new - 1) * stride + heads_kv * dim, stride, dim, 1)
    k, v = (torch.empty(strides[0], device=DEVICE, dtype=dtype).as_strided(shape, strides) for _ in range(2))
    k.copy_(torch.randn(shape, device=DEVICE, dtype=dtype))
    v.copy_(torch.randn(shape, device=DEVICE, dtype=dtype))
    q = torch.randn(1, new, 4, dim, device=DEVICE, dtype=dtype)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k, v=v, is_causal=True)
    assert torch.equal(k_cache[0, 5:8], k[0]) and torch.equal(v_cache[0, 5:8], v[0])
    assert torch.isfinite(out).all()
