"""Host (Python) time per call of small llm-speed ops against PyTorch's, and where it goes (cProfile).

On a GPU a 512^3 GEMM takes a few microseconds of kernel time; what a user waits for at that size is the
launch path, unless the kernel itself is slow for the size. Prints, per case, the wall microseconds per
call (1000 calls, one synchronize), on a GPU the kernel microseconds per call (``torch.profiler``: the CUDA
kernels' summed device time over the same calls), and the top of a cProfile listing of the llm-speed calls.
"""

import cProfile
import pstats
import time

import torch

import llm_speed

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
calls = 1000 if device.type == "cuda" else 3
a, b = (torch.randn(512, 512, device=device, dtype=dtype) for _ in range(2))
q, k, v = (torch.randn(1, 16, 128, 128, device=device, dtype=dtype) for _ in range(3))
cases = {
    "llm_speed.gemm 512^3": lambda: llm_speed.gemm(a, b),
    "torch.matmul 512^3": lambda: a @ b,
    "llm_speed.flash_attention 1x16x128x128": lambda: llm_speed.flash_attention(q, k, v),
    "sdpa 1x16x128x128": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
}
for name, fn in cases.items():
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - began) / calls * 1e6
    kernel = ""
    if device.type == "cuda":
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
        events = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        device_us = sum(e.device_time_total for e in events) / 100
        kernel = f", kernels {device_us:.1f} us per call ({', '.join(sorted(e.key[:40] for e in events))})"
    print(f"{name}: wall {wall_us:.1f} us per call{kernel}", flush=True)
for name in ("llm_speed.gemm 512^3", "llm_speed.flash_attention 1x16x128x128"):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(min(calls, 200)):
        cases[name]()
    profile.disable()
    print(f"--- {name}: cProfile, cumulative")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(22)
