"""Time flash attention under several block configurations in one process (a GPU tuning call).

Each configuration replaces the shipped one (``attention.plans.attention_config``, plans made afresh), is
checked against PyTorch SDPA on the same inputs (max error, so a fast but wrong configuration shows), and
is timed with ``triton.testing.do_bench`` (median) beside SDPA's cuDNN and flash backends. One JSON line
per measurement on stdout. On the CPU (``--smoke``) it runs tiny shapes through the interpreter.

    python benchmarks/attention_sweep.py [--smoke] [--only fwd|bwd] > sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from llm_speed.attention import flash_attention
from llm_speed.attention import plans as attention_plans
from llm_speed.core.config import KernelConfig
from llm_speed.core.launch import clear_plans
from llm_speed.perf.kernel_costs import attention_cost

# (block_m, block_n, num_warps, num_stages); the first of each list is the one shipped for 227 KB devices.
# The first call (2026-11-22, H100) swept FULL's rows and neighbours; this list refines around its winners.
FORWARD = {
    128: [(128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (128, 64, 8, 3), (64, 128, 8, 3),
          (128, 128, 8, 2)],
    64: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 4), (64, 64, 8, 3), (128, 32, 8, 3)],
}  # fmt: skip
BACKWARD = {
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2), (64, 64, 4, 1), (32, 64, 4, 3),
          (128, 128, 8, 2), (64, 32, 4, 2)],
    64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2), (128, 128, 8, 2), (64, 64, 8, 2)],
}  # fmt: skip
SDPA = {"sdpa-cudnn": "CUDNN_ATTENTION", "sdpa-flash": "FLASH_ATTENTION"}


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median")
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(getattr(SDPBackend, SDPA[backend])):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def measure(direction, head_dim, seq, causal, config, device, dtype, references, tokens=16384):
    """Rows for flash under ``config`` and, the first time a problem is seen, for SDPA's backends (whose
    output is kept in ``references`` to check every configuration against)."""
    heads = 2048 // head_dim
    batch = max(1, tokens // seq)
    torch.manual_seed(0)  # the same inputs for every configuration
    q, k, v, grad = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype) for _ in range(4))
    cost = attention_cost(batch, heads, seq, seq, head_dim, causal=causal, dtype="fp16", mode=direction)
    flops = cost.flops  # the model's count: backward = 2.5x forward
    row = dict(direction=direction, head_dim=head_dim, seq=seq, batch=batch, heads=heads, causal=causal)
    key = (direction, head_dim, seq, causal)
    impls = {"flash": lambda q, k, v, c: flash_attention(q, k, v, is_causal=c)}
    if key not in references:
        impls.update({name: _sdpa(name) for name in SDPA} if device.type == "cuda" else {})
        impls["reference"] = lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)
    for name, fn in reversed(list(impls.items())):  # the reference first
        try:
            leaves = [t.detach().requires_grad_(direction == "bwd") for t in (q, k, v)]
            out = fn(*leaves, causal)
            if direction == "fwd":
                result, run = out, (lambda fn=fn, leaves=leaves: fn(*leaves, causal))
            else:
                result = torch.autograd.grad(out, leaves, grad, retain_graph=True)[0]
                run = lambda out=out, leaves=leaves: torch.autograd.grad(  # noqa: E731
                    out, leaves, grad, retain_graph=True
                )
            if name == "reference":
                references[key] = result
                continue
            ms = _time_ms(run)
            entry = dict(row, impl=name, ms=ms, tflops=flops / ms / 1e9)
            if name == "flash":
                entry["max_error_vs_sdpa"] = (result.float() - references[key].float()).abs().max().item()
        except Exception as error:  # out of resources, or a backend that refuses the shape
            entry = dict(row, impl=name, error=f"{type(error).__name__}: {str(error)[:200]}")
        if name == "flash":
            entry["config"] = list(config)
        yield entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    parser.add_argument("--only", choices=("fwd", "bwd"))
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    seq = 64 if args.smoke else 16384
    plans = []
    for direction, table, name in (("fwd", FORWARD, "forward"), ("bwd", BACKWARD, "backward")):
        if args.only and direction != args.only:
            continue
        for head_dim, configs in table.items():
            for entry in configs[:2] if args.smoke else configs:
                plans.append((direction, name, head_dim, entry))
    references: dict = {}
    for direction, name, head_dim, entry in plans:
        config = KernelConfig(*entry)
        original = attention_plans.attention_config

        def pinned(direction, block_d, dtype, hardware, name=name, config=config, original=original):
            return config if direction == name else original(direction, block_d, dtype, hardware)

        attention_plans.attention_config = pinned
        clear_plans()  # plans made under another configuration
        try:
            for row in measure(
                direction,
                head_dim,
                seq,
                False,
                entry,
                device,
                dtype,
                references,
                tokens=seq if args.smoke else 16384,
            ):
                print(json.dumps(row), flush=True)
        finally:
            attention_plans.attention_config = original
            clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
