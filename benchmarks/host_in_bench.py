"""Where a call's time goes inside the bench loop, on a GPU: host time of the call itself, the timed interval
the bench reports (CUDA events around the call, the L2 flushed before it), and the kernel's own time from
`torch.profiler`, for `llm_speed.gemm` against `torch.matmul`, and for a decode step of
`flash_attention_with_kvcache` (dense and paged) against SDPA over a dense cache, side by side.

On 2026-11-25 (H100 SXM) `bench gemm` measured 65 / 80 us at 1024^3 / 2048^3 against cuBLAS's 17 / 29, but
parity at 4096^3 and 8192^3, while a tiny call cost 32 us against 18 back to back: the flush (~35 us of GPU
time) should hide a host path that short. `bench decode` measured 88-153 us a step (16-bit caches, batch
1-8, contexts 1024-4096) against SDPA's 49-66, far above both host paths (54 and 27 us back to back) and the
kernels' few us. This measures which it is (docs/guides/host-path.md).

    python benchmarks/host_in_bench.py --output host_in_bench.json

Not a test: it needs CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import llm_speed
from llm_speed.bench.timing import L2_FLUSH_FACTOR, l2_cache_bytes

SIZES = (512, 1024, 2048, 4096)
DECODE = ((1, 1024), (1, 4096), (8, 4096), (32, 4096))  # (batch, context): bench decode's settings below
HEADS, HEADS_KV, HEAD_DIM, PAGE = 32, 8, 128, 256


def in_bench_loop(fn, flush: torch.Tensor, runs: int) -> dict:
    """Median host time of ``fn`` (us) and of the event interval around it, each run after an L2 flush, as
    llm_speed.bench.timing times a call."""
    host, starts, ends = [], [], []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        start.record()
        began = time.perf_counter()
        fn()
        host.append((time.perf_counter() - began) * 1e6)
        end.record()
        starts.append(start)
        ends.append(end)
    torch.cuda.synchronize()
    timed = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
    return {"host_us": statistics.median(host), "timed_us": statistics.median(timed)}


def back_to_back(fn, runs: int) -> float:
    """Median host time of ``fn`` (us) called back to back without a flush (`bench overhead`'s setting)."""
    host = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        host.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(host)


def kernel_us(fn, runs: int) -> float:
    """Mean GPU kernel time per call (us) from torch.profiler, the flush excluded."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total)
    return total / runs


def gemm_calls(device: torch.device):
    """(size, impl, call) of the GEMMs."""
    for size in SIZES:
        a, b = (torch.randn(size, size, device=device, dtype=torch.float16) for _ in range(2))
        yield size, "llm-speed", lambda a=a, b=b: llm_speed.gemm(a, b)
        yield size, "torch", lambda a=a, b=b: torch.matmul(a, b)


def decode_calls(device: torch.device):
    """(batch x context, impl, call) of the decode steps, as `bench decode` builds them."""
    step = llm_speed.flash_attention_with_kvcache
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for batch, context in DECODE:
        label = f"{batch}x{context}"
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device=device, dtype=torch.float16)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        dense = (torch.randn(batch, context, HEADS_KV, HEAD_DIM, device=device, dtype=torch.float16)
                 for _ in range(2))  # fmt: skip
        yield label, "kvcache", functools.partial(step, q, *dense, cache_seqlens=lens)
        pages = -(-context // PAGE)
        paged = (torch.randn(batch * pages, PAGE, HEADS_KV, HEAD_DIM, device=device, dtype=torch.float16)
                 for _ in range(2))  # fmt: skip
        table = torch.randperm(batch * pages, device=device).to(torch.int32).reshape(batch, pages)
        yield label, "kvcache-paged", functools.partial(step, q, *paged, cache_seqlens=lens,
                                                        block_table=table)  # fmt: skip
        k, v = (torch.randn(batch, HEADS_KV, context, HEAD_DIM, device=device, dtype=torch.float16)
                for _ in range(2))  # fmt: skip
        yield label, "sdpa", functools.partial(sdpa, q.transpose(1, 2), k, v, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(L2_FLUSH_FACTOR * l2_cache_bytes(device) // 4, dtype=torch.int32, device=device)
    rows = []
    for group, calls in (("gemm", gemm_calls(device)), ("decode", decode_calls(device))):
        for size, name, fn in calls:
            with torch.no_grad():
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                row = {"group": group, "size": size, "impl": name, **in_bench_loop(fn, flush, args.runs),
                       "back_to_back_host_us": back_to_back(fn, args.runs), "kernel_us": kernel_us(fn, 50)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.output, "w") as out:
        environment = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        json.dump({**environment, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
