"""CUDA graphs, on a GPU: a decode step (paged, with append) captured once in ``torch.cuda.CUDAGraph`` and
replayed with new ``cache_seqlens``, block table and inputs equals eager; a training step of the fused ops and
attention under ``torch.compile(mode="reduce-overhead")`` equals eager. On a CPU,
``tests/core/test_no_host_reads.py`` stands in: a host read would make either impossible.
"""

from __future__ import annotations

import pytest
import torch

import llm_speed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEVICE = "cuda"


def _decode_inputs(batch, heads_q, heads_kv, dim, pages_per_seq, page_size, dtype, generator):
    pool = batch * pages_per_seq + 3
    k_cache = torch.randn(pool, page_size, heads_kv, dim, device=DEVICE, dtype=dtype, generator=generator)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pool, device=DEVICE, generator=generator)[: batch * pages_per_seq]
    table = table.to(torch.int32).reshape(batch, pages_per_seq)
    capacity = pages_per_seq * page_size
    seqlens = torch.randint(0, capacity - 1, (batch,), device=DEVICE, generator=generator).to(torch.int32)
    q = torch.randn(batch, 1, heads_q, dim, device=DEVICE, dtype=dtype, generator=generator)
    k, v = (torch.randn(batch, 1, heads_kv, dim, device=DEVICE, dtype=dtype, generator=generator) for _ in
    range(2))
    return k_cache, v_cache, table, seqlens, q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_replayed_from_a_cuda_graph_equals_eager(dtype):
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    shape = dict(batch=8, heads_q=32, heads_kv=8, dim=128, pages_per_seq=16, page_size=64, dtype=dtype)
    static = _decode_inputs(**shape, generator=generator)
    k_cache, v_cache, table, seqlens, q, k, v = static

    def step():
        return llm_speed.flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, block_table=table, is_causal=True
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph: compiles, makes the plans
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(3):  # new lengths, pages and inputs, copied into the captured tensors
        fresh = _decode_inputs(**shape, generator=generator)
        for target, source in zip(static, fresh, strict=True):
            target.copy_(source)
        eager_caches = (k_cache.clone(), v_cache.clone())
        graph.replay()
        replayed = static_out.clone()
        replayed_caches = (k_cache.clone(), v_cache.clone())
        k_cache.copy_(eager_caches[0])
        v_cache.copy_(eager_caches[1])
        expected = step()
        torch.testing.assert_close(replayed, expected, rtol=0, atol=0)
        torch.testing.assert_close(replayed_caches, (k_cache, v_cache), rtol=0, atol=0)


def _layer(x, norm_weight, w_gate, w_up, w_down, qkv, cos, sin):
    h = llm_speed.rms_norm(x, norm_weight)
    b, s, d = h.shape
    q, k, v = (t.view(b, s, 4, d // 4).transpose(1, 2) for t in (h @ qkv[0], h @ qkv[1], h @ qkv[2]))
    q, k = llm_speed.apply_rotary(q, cos, sin), llm_speed.apply_rotary(k, cos, sin)
    a = llm_speed.flash_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    x = x + a
    mlp = llm_speed.swiglu(llm_speed.gemm(x.view(-1, d), w_gate), llm_speed.gemm(x.view(-1, d), w_up))
    return x + (mlp @ w_down).view(b, s, d)


def test_training_step_under_reduce_overhead_equals_eager():
    torch.manual_seed(0)
    d, vocab = 256, 512
    dtype = torch.float32  # IEEE products on both sides: the two runs may differ only by summation order
    params = [
        torch.ones(d, device=DEVICE, dtype=dtype),
        *(torch.randn(d, 4 * d, device=DEVICE, dtype=dtype) * d**-0.5 for _ in range(2)),
        torch.randn(4 * d, d, device=DEVICE, dtype=dtype) * (4 * d) ** -0.5,
        torch.randn(3, d, d, device=DEVICE, dtype=dtype) * d**-0.5,
        torch.randn(vocab, d, device=DEVICE, dtype=dtype) * d**-0.5,
    ]
    params = [p.requires_grad_() for p in params]
    angles = torch.arange(64, device=DEVICE)[:, None] * torch.rand(d // 8, device=DEVICE)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def loss_of(x, target):
        norm, gate, up, down, qkv, head = params
        y = _layer(x, norm, gate, up, down, qkv, cos, sin)
        return llm_speed.fused_linear_cross_entropy(y.view(-1, d), head, target.view(-1))

    def step(x, target):
        for p in params:
            p.grad = None
        loss = loss_of(x, target)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    compiled = torch.compile(step, mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(2, 64, d, device=DEVICE, dtype=dtype)
        target = torch.randint(0, vocab, (2, 64), device=DEVICE)
        got_loss, got_grads = compiled(x, target)
        want_loss, want_grads = step(x, target)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=1e-5)
        for got, want in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
