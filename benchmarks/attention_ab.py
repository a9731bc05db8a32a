"""A/B timings of attention variants in one process, on a GPU: the forward with and without its softmax
overlapping the next block's QK^T (``flash.OVERLAP_HEAD_DIMS``; the one-product loop also at its former
128x128 tile at d=128; the overlapped loop with K/V by pointers, ``flash.TMA_KV_LOADS``), the causal launch
order (longest first against row order) and the backward (dQ by atomics or by its own kernel; the dK/dV
tile; dQ tiles added by TMA bulk reductions, ``flash.TMA_DQ_ADD``; the streamed tiles by pointer loads
instead of TMA, ``flash.TMA_BACKWARD_HEAD_DIMS``) beside cuDNN's (and, forward, SDPA's flash backend), and
(``--packed``) packed sequences with their bounds in uniform registers or not (``flash.uniform_switch``).
Each variant is a patch of one launcher choice (``flash.OVERLAP_HEAD_DIMS``, ``flash._launch_order`` or
``flash.attention_config``); plans are cleared between variants, and the variants alternate over
``--rounds`` rounds so that clock drift hits each the same.

    python benchmarks/attention_ab.py --output ab.json

Prints one line per measurement and writes every median (ms) to ``--output``. Not a test: it needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import statistics
import sys

import torch
from triton.testing import do_bench

from llm_speed.attention import flash
from llm_speed.core import launch

LAUNCH_SHAPES = (
    (1, 16384),
    (2, 8192),
    (4, 4096),
    (8, 2048),
    (16, 1024),
)  # (batch, seq) at 16 heads, d=128, causal
BACKWARD_TILES = ("shipped", (64, 64, 4), (128, 64, 8))


@contextlib.contextmanager
def patched(name: str, value):
    """``flash.<name>`` set to ``value`` inside the block (a launcher switch or function), plans cleared on
    the way in and out (a plan keeps what it read)."""
    saved = getattr(flash, name)
    setattr(flash, name, value)
    launch.clear_plans()
    try:
        yield
    finally:
        setattr(flash, name, saved)
        launch.clear_plans()


def launch_order(lpt: bool):
    """Longest-first (the build's own order) or row order (every program in grid order)."""
    if lpt:
        return patched("_launch_order", flash._launch_order)
    return patched("_launch_order", lambda *args, **kwargs: {"section": 1, "LPT": False})


FORWARD_SHAPES = ((1, 16384), (4, 4096))  # (batch, seq) at 16 heads, fp16
# (name, head dims whose forward overlaps, forward tile at d=128 or "shipped", K/V by TMA where the plan
# allows): shipped is "overlap" at d=128 and "one-product" at d=64 (flash.OVERLAP_HEAD_DIMS), TMA at d=128.
# "overlap pointer-loads" (flash.TMA_KV_LOADS off): the overlapped interior loop is 383 SASS instructions with
# cp.async against 430 with TMA (sm_90a, 2026-11-26), 202 registers against 193.
FORWARD_VARIANTS = (("overlap", (64, 128), "shipped", True), ("one-product", (), "shipped", True),
                    ("one-product 128x128", (), (128, 128, 8, 3), True),
                    ("overlap pointer-loads", (64, 128), "shipped", False))  # fmt: skip


@contextlib.contextmanager
def pinned_tile(tile, direction="backward", block_d=None):
    """Launch ``direction``'s kernels (at head dim ``block_d`` only, when given) with ``tile``."""
    saved = flash.attention_config
    if tile != "shipped":
        block_m, block_n, warps = tile[:3]

        def patched(direction_asked, block_d_asked, dtype, hardware):
            cfg = saved(direction_asked, block_d_asked, dtype, hardware)
            if direction_asked != direction or block_d not in (None, block_d_asked):
                return cfg
            stages = {"num_stages": tile[3]} if len(tile) > 3 else {}
            return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, num_warps=warps, **stages)

        flash.attention_config = patched
    launch.clear_plans()
    try:
        yield
    finally:
        flash.attention_config = saved
        launch.clear_plans()


def atomic_dq():
    """The backward's five-matmul path (dQ added by element atomics from the dK/dV kernel) on a tier that
    computes dQ in its own kernel by default (Hopper's: ``Tier.dq_kernel``), where ``deterministic=False``
    alone keeps the dQ kernel. (Before 2026-11-25's thirteenth session the "atomic" rows lacked this patch: on
    the H100 they timed the dQ-kernel path; its rows are "atomic-dq" now.)"""
    tier_for = flash.tier_for
    return patched("tier_for", lambda hardware: dataclasses.replace(tier_for(hardware), dq_kernel=False))


# The backward's path patches of the A/B rows: dQ tiles added by TMA bulk reductions (flash.TMA_DQ_ADD), and
# the streamed tiles (Q and dO in the dK/dV kernel, K and V in the dQ kernel) by pointer loads, as before
# 2026-11-26's fifteenth session, instead of TMA (flash.TMA_BACKWARD_HEAD_DIMS).
BACKWARD_PATCHES = {"tma-dq-add": ("TMA_DQ_ADD", True), "pointer-loads": ("TMA_BACKWARD_HEAD_DIMS", ())}


def qkv(batch, seq, heads=16, head_dim=128, dtype=torch.bfloat16, grad=False):
    return [torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=grad)
            for _ in range(3)]  # fmt: skip


def time_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def backward_ab(record, tiles, extra) -> None:
    """The backward of 1 x 16 heads x 16384, fp16, full and causal: cuDNN's, then ours on each path and tile.
    d = 128 with every variant; d = 64 (rows named "d64") the shipped tile on both paths, its atomic-dQ
    kernel holding two blocks per SM whole (docs/guides/attention-hopper.md). "atomic-dq": the five-matmul
    path forced (before 2026-11-25's thirteenth session, rows named "atomic" ran the build's default)."""
    for head_dim in (128, 64):
        q, k, v = qkv(1, 16384, head_dim=head_dim, dtype=torch.float16, grad=True)
        dout = torch.randn_like(q)
        shape = "1x16384" if head_dim == 128 else f"1x16384 d{head_dim}"
        for causal in (False, True):
            label = f"backward {'causal' if causal else 'full'} {shape} fp16"

            def timed(out, name, inputs=(q, k, v), dout=dout, label=label):
                fn = lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)  # noqa: E731
                fn()
                record(f"{label} {name}", time_ms(fn))

            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                timed(out, "sdpa-cudnn")
            # (tile, deterministic, patch: None, "tma-dq-add" or "pointer-loads")
            shapes = tiles if head_dim == 128 else ("shipped",)
            variants = [(tile, det, None) for det in (False, True) for tile in shapes]
            if head_dim == 128:
                variants += [("shipped", False, "tma-dq-add"), ("shipped", True, "pointer-loads")]
                variants += [(tile, False, None) for tile in extra]
            for tile, deterministic, patch in variants:
                name = tile if tile == "shipped" else "x".join(map(str, tile[:2])) + f" w{tile[2]}"
                name += f" s{tile[3]}" if tile != "shipped" and len(tile) > 3 else ""
                name += " deterministic" if deterministic else " atomic-dq" if patch is None else ""
                name += f" {patch}" if patch else ""
                path = (patched(*BACKWARD_PATCHES[patch]) if patch
                        else contextlib.nullcontext() if deterministic else atomic_dq())  # fmt: skip
                try:
                    with pinned_tile(tile), path:
                        out = flash.flash_attention(q, k, v, is_causal=causal, deterministic=deterministic)
                        timed(out, name)
                except Exception as error:  # a tile that does not fit (or a variant that fails) is a finding
                    print(f"{label} {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)


# Packed sequences (flash_attention_varlen, as Hugging Face's padded batches reach it): 8 ragged causal
# sequences, 16384 tokens, 16 query heads on 4, d = 128, bf16; the sequences' bounds in uniform registers
# (``UNIFORM``, redux.sync: sm_90a interior loops forward 464 -> 431, dQ 370 -> 288, dK/dV 520 -> 422) or, as
# before 2026-11-26's sixteenth session, in per-thread ones.
PACKED_LENGTHS = (3000, 1000, 2500, 1500, 4000, 500, 2384, 1500)


def packed_ab(record) -> None:
    """Forward and backward (the build's default path) of the packed problem, UNIFORM on and off."""
    from llm_speed.attention.varlen import flash_attention_varlen

    total = sum(PACKED_LENGTHS)
    cu = torch.tensor([0, *PACKED_LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    dout = torch.randn_like(q)
    longest = max(PACKED_LENGTHS)
    label = f"packed causal {len(PACKED_LENGTHS)} seqs {total} tokens h16/4 d128 bf16"
    for name, switch in (("uniform", flash.uniform_switch), ("per-thread", lambda hardware: False)):
        with patched("uniform_switch", switch):
            call = lambda: flash_attention_varlen(q, k, v, cu, cu, longest, longest, is_causal=True)  # noqa: E731
            with torch.no_grad():
                call()
                record(f"fwd {label} {name}", time_ms(call))
            out = call()
            grads = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
            grads()
            record(f"backward {label} {name}", time_ms(grads))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-forward", action="store_true")
    parser.add_argument("--skip-backward", action="store_true")
    parser.add_argument("--skip-launch-order", action="store_true")
    parser.add_argument("--packed", action="store_true", help="also the packed sequences' A/B (UNIFORM)")
    parser.add_argument("--backward-tiles", choices=("all", "shipped"), default="all",
                        help="the dK/dV tiles of the backward rows: shipped, or all")  # fmt: skip
    parser.add_argument("--tile", action="append", default=[], metavar="MxNwW[sS]",
                        help="a backward tile to time (atomic dQ) besides --backward-tiles: BLOCK_M "
                        "x BLOCK_N, warps, stages (default: the shipped config's); repeatable")  # fmt: skip
    args = parser.parse_args(argv)
    tiles = BACKWARD_TILES if args.backward_tiles == "all" else ("shipped",)
    extra = []
    for text in args.tile:
        match = re.fullmatch(r"(\d+)x(\d+)w(\d+)(?:s(\d+))?", text)
        if match is None:
            parser.error(f"--tile: {text!r} is not MxNwW or MxNwWsS (e.g. 64x128w8s2)")
        extra.append(tuple(int(g) for g in match.groups() if g is not None))
    if not torch.cuda.is_available():
        print("attention_ab.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    results: dict[str, list[float]] = {}

    def record(name, ms):
        results.setdefault(name, []).append(ms)
        print(f"{name}: {ms:.4f} ms", flush=True)

    for _ in range(args.rounds):
        for (batch, seq), head_dim, causal in (
            () if args.skip_forward
            else [(shape, d, c) for shape in FORWARD_SHAPES for d in (128, 64) for c in (False, True)]
        ):  # fmt: skip
            q, k, v = qkv(batch, seq, head_dim=head_dim, dtype=torch.float16)
            point = f"fwd {'causal' if causal else 'full'} {batch}x16x{seq} d{head_dim} fp16"
            with torch.no_grad():
                for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                    with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
                        fn = lambda q=q, k=k, v=v, c=causal: (  # noqa: E731
                            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
                        )
                        fn()
                        record(f"{point} sdpa-{backend.split('_')[0].lower()}", time_ms(fn))
                for name, head_dims, tile, tma in FORWARD_VARIANTS:
                    if (tile != "shipped" or not tma) and head_dim != 128:
                        continue
                    with (
                        patched("OVERLAP_HEAD_DIMS", head_dims),
                        pinned_tile(tile, "forward", 128),
                        patched("TMA_KV_LOADS", tma),
                    ):
                        fn = lambda q=q, k=k, v=v, c=causal: flash.flash_attention(q, k, v, is_causal=c)  # noqa: E731
                        fn()
                        record(f"{point} {name}", time_ms(fn))
        for batch, seq in () if args.skip_launch_order else LAUNCH_SHAPES:
            q, k, v = qkv(batch, seq)
            for lpt in (True, False):
                with launch_order(lpt), torch.no_grad():
                    fn = lambda q=q, k=k, v=v: flash.flash_attention(q, k, v, is_causal=True)  # noqa: E731
                    fn()
                    record(f"causal fwd {batch}x{seq} {'lpt' if lpt else 'row'}", time_ms(fn))
        if args.packed:
            packed_ab(record)
        if args.skip_backward:
            continue
        backward_ab(record, tiles, extra)
    summary = {name: {"median_ms": statistics.median(runs), "runs": runs} for name, runs in results.items()}
    with open(args.output, "w") as file:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": summary},
                  file, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
