"""Where a GEMM call's time goes inside the bench loop, on a GPU: host time of the call itself, the timed
interval `bench gemm` reports (CUDA events around the call, the L2 flushed before it), and the kernel's own
time from `torch.profiler`, for `llm_speed.gemm` and `torch.matmul` side by side.

On 2026-11-25 (H100 SXM) `bench gemm` measured 65 / 80 us at 1024^3 / 2048^3 against cuBLAS's 17 / 29, but
parity at 4096^3 and 8192^3, while a tiny call cost 32 us against 18 back to back: the flush (~35 us of GPU
time) should hide a host path that short. This measures which it is (docs/notes/launch-path.md).

    python benchmarks/host_in_bench.py --output host_in_bench.json

Not a test: it needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import llm_speed
from llm_speed.bench.timing import L2_FLUSH_FACTOR, l2_cache_bytes

SIZES = (512, 1024, 2048, 4096)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    device = torch.device("cuda")
    flush = torch.empty(L2_FLUSH_FACTOR * l2_cache_bytes(device) // 4, dtype=torch.int32, device=device)
    rows = []
    for size in SIZES:
        a, b = (torch.randn(size, size, device=device, dtype=torch.float16) for _ in range(2))
        calls = (("llm-speed", lambda a=a, b=b: llm_speed.gemm(a, b)),
                 ("torch", lambda a=a, b=b: torch.matmul(a, b)))  # fmt: skip
        for name, fn in calls:
            with torch.no_grad():
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                row = {"size": size, "impl": name, **in_bench_loop(fn, flush, args.runs),
                       "back_to_back_host_us": back_to_back(fn, args.runs), "kernel_us": kernel_us(fn, 50)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.output, "w") as out:
        environment = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        json.dump({**environment, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
