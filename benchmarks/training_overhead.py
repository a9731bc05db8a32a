"""Where a training-mode call's time goes on a GPU (2026-11-25 H100: ``bench overhead --modes training``
put flash_attention at 647 us a call against SDPA's 283 us, rms_norm 522 against F.rms_norm's 202, on a
tiny problem whose kernels take 7-19 us).

For each case of ``llm_speed.bench.overhead``: wall time of a forward + backward call (as that mode times
it) with the autograd engine's device threads (PyTorch's default) and with
``torch.autograd.set_multithreading_enabled(False)`` (the backward on the calling thread); then, threads
off, a cProfile of our ops' calls, the top functions by own time.

    python benchmarks/training_overhead.py [--calls N] [--profile flash_attention rms_norm ...]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

from llm_speed.bench import overhead


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", nargs="*", default=["flash_attention", "rms_norm", "gemm"])
    parser.add_argument("--output", default=None, help="JSON file for the timings")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    by_name = {case.name: case for case in overhead.CASES}
    rows = []

    def us_per_call(fn, repeats: int = 3) -> float:  # bench overhead's timing: fastest of `repeats` runs
        return round(overhead._time(fn, args.calls, repeats, device, time.perf_counter), 1)

    def training_row(name: str, call) -> dict:
        """Forward + backward of ``call`` with the engine's device threads and without."""
        fn = overhead._runner(call, "training")
        row = {"case": name}
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                row["threads" if threads else "no_threads"] = us_per_call(fn)
        return row

    for name in ("sdpa", "torch.matmul", "F.rms_norm", "silu(gate) * up", "flash_attention", "gemm",
                 "rms_norm", "swiglu", "apply_rotary", "fused_linear_cross_entropy"):
        case = by_name[name]
        row = training_row(name, case.make(device, dtype, True))
        row["forward_only"] = us_per_call(case.make(device, dtype, True), repeats=1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    # The engine's cost of a Python backward: x * 2 as PyTorch's own node, and as an autograd.Function whose
    # backward runs 1 or 6 PyTorch ops (each output of the forward is a fresh tensor, as in our ops).
    x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)

    def function_with(ops: int):
        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t * 2

            @staticmethod
            def backward(ctx, grad):
                for _ in range(ops - 1):
                    grad = grad + 0
                return grad * 2

        return lambda: Twice.apply(x)

    probes = {"x * 2 (C++ node)": lambda: x * 2, "Function, 1 op": function_with(1),
              "Function, 6 ops": function_with(6)}
    for name, call in probes.items():
        rows.append(training_row(name, call))
        print(json.dumps(rows[-1]), flush=True)
    for name in args.profile:
        fn = overhead._runner(by_name[name].make(device, dtype, True), "training")
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(20):
                fn()
            sync()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                fn()
            sync()
            profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
        print(f"--- {name}: cProfile of {args.calls} training calls, threads off, by own time")
        print("\n".join(text.getvalue().splitlines()[:48]))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "calls": args.calls, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
