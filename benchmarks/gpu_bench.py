#!/usr/bin/env python3
"""The benchmark sets of run_gpu_suite.sh, run in one process, one shape per ``llm-speed`` call.

Each call writes its own JSON as soon as its shape is measured, so a step cut by its time cap still returns
every shape it finished; one process pays the torch import and CUDA start once. With ``--check`` every
line is only parsed by the real ``llm-speed`` argument parser (a CPU dry run: the flags exist).

    python benchmarks/gpu_bench.py SET OUTDIR [--check]      SET: attention, gemm, decode, demo,
                                                              ops, train-step, moe, fp8, or the
                                                              proof's proof-attention, proof-gemm,
                                                              proof-fp8, proof-decode, proof-ce,
                                                              proof-train-step
    python benchmarks/gpu_bench.py --list SET OUTDIR          print the command lines
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback

QUICK = "--warmup 5 --iterations 20 --no-progress"
# The proof's headline (issue 70 1b): few runs a row, since its 240 s hold the cold compiles too.
PROOF = "--warmup 3 --iterations 10 --min-time 0 --no-progress"
PROOF_SETS = ("proof-attention", "proof-gemm", "proof-fp8", "proof-decode", "proof-ce", "proof-train-step")
SETS = ("attention", "gemm", "decode", "demo", "ops", "train-step", "moe", "fp8", *PROOF_SETS)
SDPA_BACKENDS = "sdpa-flash sdpa-efficient sdpa-cudnn"
# The head dims of issue 37's target (not slower than the next multiple of 16 above each: 80 -> 96,
# 96 -> 112, 111 -> 112) and those they are compared with (benchmarks/proof_targets.py reads both).
HEAD_DIMS = (80, 96, 111, 112)


def proof_lines(name: str, out: str) -> list[str]:
    """The headline rows of ``run_gpu_suite.sh proof``, each against its alternatives in this process."""
    lines = []
    if name == "proof-attention":
        # docs/guides/attention-hopper.md's points: batch 2, 8 heads, d = 64, fp16, against every SDPA
        # backend (math too: 2 x 8 x 8192^2 scores fit)
        for mode in ("fwd", "fwd+bwd"):
            for seq in (512, 1024, 2048, 4096, 8192):
                lines.append(
                    f"bench attention {PROOF} --dtype fp16 --mode {mode} --batch-size 2 --num-heads 8 "
                    f"--head-dim 64 --seq-lengths {seq} "
                    f"--impl flash {SDPA_BACKENDS} sdpa-math "
                    f"--output {out}/attn_d64_{mode.replace('+', '_')}_s{seq}.json"
                )
        # d = 128 at 16k tokens, 16 heads and GQA 4:1, causal and not. No sdpa-math: its backward keeps
        # 16 x 16384^2 probabilities and their gradients (tens of GB) and takes seconds a call.
        for mode in ("fwd", "fwd+bwd"):
            for causal in ("", "--causal "):
                for kv in (16, 4):
                    label = f"{'causal' if causal else 'full'}_{'mha' if kv == 16 else 'gqa'}"
                    lines.append(
                        f"bench attention {PROOF} --dtype bf16 --mode {mode} {causal}--batch-size 1 "
                        f"--num-heads 16 --num-kv-heads {kv} --head-dim 128 --seq-lengths 16384 "
                        f"--impl flash {SDPA_BACKENDS} "
                        f"--output {out}/attn_d128_{mode.replace('+', '_')}_{label}_s16384.json"
                    )
        # fp8 attention (e4m3 q, k, v, per-tensor descales) against our bf16 forward at the same point, in
        # its own file: beside the SDPA rows above it would be the flash row's "fastest other"
        lines.append(
            f"bench attention {PROOF} --dtype bf16 --mode fwd --batch-size 1 --num-heads 16 --head-dim 128 "
            f"--seq-lengths 16384 --impl flash flash-fp8 "
            f"--output {out}/attn_d128_fp8_fwd_full_mha_s16384.json"
        )
        # head dims real models use or flash-attn's tests take (issue 37: 80, 96, 111), each against the next
        # multiple of 16 above it, forward, bf16, 16 heads x 4096 tokens, ours only (two compiles: the head
        # dim and the row stride specialize on divisibility by 16); last, so a cut part loses only these
        for head_dim in HEAD_DIMS:
            lines.append(
                f"bench attention {PROOF} --dtype bf16 --mode fwd --batch-size 1 --num-heads 16 "
                f"--head-dim {head_dim} --seq-lengths 4096 --impl flash "
                f"--output {out}/attn_hdim{head_dim}_fwd_s4096.json"
            )
    elif name == "proof-gemm":
        for size in (512, 1024, 2048, 4096, 8192):
            lines.append(
                f"bench gemm {PROOF} --dtype bf16 --sizes {size}x{size}x{size} --impl llm-speed torch "
                f"--output {out}/gemm_bf16_{size}.json"
            )
        for tokens in (1, 16, 4096):
            lines.append(
                f"bench gemm {PROOF} --dtype bf16 --layout NT --model llama-3-8b --tokens {tokens} "
                f"--impl llm-speed torch --output {out}/gemm_bf16_llama3_8b_m{tokens}.json"
            )
    elif name == "proof-fp8":
        # per tensor, per row and blockwise, each against torch._scaled_mm (fast accumulation) and bf16
        lines.append(f"bench gemm {PROOF} --dtype fp8 --layout NT --sizes 4096x4096x4096 "
                     f"--output {out}/gemm_fp8_4096.json")  # fmt: skip
    elif name == "proof-decode":
        # bf16, 32 query heads on 8 KV heads of d = 128 (the GPU defaults), 4k context: dense, 16-token
        # pages, SDPA; eager and replayed from a CUDA graph. One batch a call.
        for batch in (1, 8, 64):
            lines.append(
                f"bench decode --warmup 3 --iterations 20 --no-progress --dtype bf16 --contexts 4096 "
                f"--batch-sizes {batch} --page-size 16 --impl kvcache kvcache-paged sdpa "
                f"--output {out}/decode_bf16_b{batch}_c4096.json"
            )
        # the fp8 cache (e4m3, per-head descales) against the 16-bit one at batch 64, dense and paged: its own
        # file, the 16-bit rows timed again beside it (each fp8 row's vs_16bit_cache)
        lines.append(
            "bench decode --warmup 3 --iterations 20 --no-progress --dtype bf16 --contexts 4096 "
            "--batch-sizes 64 --page-size 16 --impl kvcache kvcache-paged kvcache-fp8 kvcache-paged-fp8 "
            f"--output {out}/decode_fp8_cache_b64_c4096.json"
        )
    elif name == "proof-ce":
        # V = 128256, N = 8192, H = 4096 (the GPU defaults): time and peak memory, every implementation
        lines.append(
            "bench ops --ops linear_cross_entropy --tokens 8192 --hidden 4096 --vocab 128256 --warmup 2 "
            f"--iterations 5 --min-time 0 --no-progress --output {out}/linear_cross_entropy.json"
        )
    elif name == "proof-train-step":
        lines.append(
            "bench train-step --model llama-3-8b --layers 2 --seq 2048 --warmup 1 --iterations 3 "
            f"--no-progress --output {out}/train_step_llama3_8b_2layers.json"
        )
    return lines


def command_lines(name: str, out: str) -> list[str]:
    """The ``llm-speed`` argument lines of one set; each writes ``out/<label>.json``."""
    if name in PROOF_SETS:
        return proof_lines(name, out)
    lines = []
    attention, gemm = f"bench attention {QUICK}", f"bench gemm {QUICK}"
    if name == "attention":
        for seq in (1024, 2048, 4096, 8192):
            lines.append(
                f"{attention} --dtype fp16 --seq-lengths {seq} --output {out}/attn_fwd_fp16_s{seq}.json"
            )
        for seq in (2048, 4096, 8192):
            lines.append(
                f"{attention} --dtype bf16 --causal --batch-size 1 --num-heads 32 --num-kv-heads 8 "
                f"--head-dim 128 --seq-lengths {seq} --output {out}/attn_gqa_causal_bf16_s{seq}.json"
            )
        for seq in (1024, 4096):
            lines.append(
                f"{attention} --dtype fp16 --mode fwd+bwd --seq-lengths {seq} "
                f"--output {out}/attn_fwd_bwd_fp16_s{seq}.json"
            )
    elif name == "gemm":
        lines.append(
            f"{gemm} --dtype bf16 --layout NT --model llama-3-8b --tokens 4096 "
            f"--output {out}/gemm_llama3_8b_bf16.json"
        )
        # decode and small-batch tokens (issue 18: M = 1 and 16 memory-bound, their GB/s against HBM's)
        for tokens in (1, 16, 128):
            lines.append(
                f"{gemm} --dtype bf16 --layout NT --model llama-3-8b --tokens {tokens} "
                f"--output {out}/gemm_llama3_8b_bf16_t{tokens}.json"
            )
        for size in (1024, 2048, 4096, 8192):
            lines.append(
                f"{gemm} --dtype fp16 --sizes {size}x{size}x{size} --output {out}/gemm_fp16_{size}.json"
            )
        for size in (2048, 4096):
            lines.append(
                f"{gemm} --dtype int8 --sizes {size}x{size}x{size} --output {out}/gemm_int8_{size}.json"
            )
        lines.append(
            f"{gemm} --dtype fp16 --epilogue bias+gelu --sizes 4096x4096x4096 "
            f"--output {out}/gemm_epilogue_4096.json"
        )
    elif name == "decode":
        # Issue 39's grid: bf16, batch x context 1 x 4k to 256 x 8k, 32 query heads of d = 128 on 4 KV heads
        # (GQA 8:1: every cache, dense and paged at 256 tokens a page, 16-bit and fp8, and SDPA) and on 32
        # (MHA: the 16-bit caches and SDPA), pages of 16 tokens (the paged caches); each step eager and
        # replayed from a CUDA graph. One batch size a call, so a cut step keeps the sizes it finished.
        grid = "--dtype bf16 --contexts 4096 8192 --num-heads 32 --no-progress"
        for batch in (1, 16, 64, 256):
            lines.append(
                f"bench decode {grid} --batch-sizes {batch} --num-kv-heads 4 "
                f"--output {out}/decode_gqa_b{batch}.json"
            )
            lines.append(
                f"bench decode {grid} --batch-sizes {batch} --num-kv-heads 32 "
                f"--impl kvcache kvcache-paged sdpa --output {out}/decode_mha_b{batch}.json"
            )
            lines.append(
                f"bench decode {grid} --batch-sizes {batch} --num-kv-heads 4 --page-size 16 "
                "--impl kvcache-paged kvcache-paged-fp8 "
                f"--output {out}/decode_gqa_p16_b{batch}.json"
            )
    elif name == "demo":
        # The per-call cost of every op on a tiny problem (wall and kernel time; forward, forward recording
        # the autograd node, forward and backward) first, then the demo.
        lines.append(f"bench overhead --modes inference autograd training --output {out}/overhead.json")
        lines.append(f"demo --output-dir {out}/demo")
    elif name == "ops":
        # GPU defaults: a Llama-3-8B layer and head at 8192 tokens, bf16, every implementation. --min-time 0:
        # the 20 runs are enough, and the step's time goes to the compiles (torch.compile and Triton).
        lines.append(f"bench ops {QUICK} --min-time 0 --output {out}/ops_llama3_8b_bf16.json")
    elif name == "train-step":
        lines.append(
            "bench train-step --model llama-3-8b --layers 2 --seq 2048 --warmup 2 --iterations 5 "
            f"--no-progress --output {out}/train_step_llama3_8b_2layers.json"
        )
    elif name == "moe":
        # GPU defaults: Qwen3-30B-A3B's experts, 2k and 8k tokens, 8/64/128 experts, top-2 and top-8, bf16;
        # forward + backward (the target) against torch._grouped_mm code and Hugging Face's loop.
        lines.append(f"bench moe {QUICK} --mode fwd+bwd --output {out}/moe_fwd_bwd_bf16.json")
    elif name == "fp8":
        # Issue 35's targets: >= 1.0x torch._scaled_mm (tensor- and row-wise) at 4096+, block scaling >= 0.8x
        # of our row-wise; each granularity against _scaled_mm with the same scaling and bf16 torch.matmul.
        # NT (b an nn.Linear weight, K-major): the layout _scaled_mm takes and fp8 wgmma reads from shared
        # memory (NN measured 0.14x: the kernel transposes b through registers every K step).
        for size in ("4096x4096x4096", "8192x8192x4096"):
            label = size.split("x")[0]
            lines.append(
                f"{gemm} --dtype fp8 --layout NT --sizes {size} --output {out}/gemm_fp8_{label}.json"
            )
    else:
        raise ValueError(f"unknown set {name!r}; expected {', '.join(SETS)}")
    return lines


def check(lines: list[str]) -> int:
    """Parse every line with the real parser; run nothing. Returns the number of lines that do not parse."""
    from llm_speed.cli import build_parser

    parser = build_parser()
    bad = 0
    for line in lines:
        try:
            parser.parse_args(shlex.split(line))
        except SystemExit:
            bad += 1
            print(f"does not parse: llm-speed {line}", flush=True)
        else:
            print(f"parses: llm-speed {line}", flush=True)
    return bad


def run(lines: list[str]) -> int:
    """Run each line in this process; a failing line is reported and the next one still runs."""
    from llm_speed.cli import main

    failed = 0
    for i, line in enumerate(lines, 1):
        began = time.monotonic()
        try:
            code = main(shlex.split(line))
        except KeyboardInterrupt:  # the step's time cap (timeout -s INT): what finished is already on disk
            print(f"[{i}/{len(lines)}] interrupted: llm-speed {line}", flush=True)
            return 124
        except Exception:  # noqa: BLE001 - one broken shape must not cost the others
            traceback.print_exc()
            code = 1
        failed += code != 0
        print(
            f"[{i}/{len(lines)}] exit {code} after {time.monotonic() - began:.1f} s: llm-speed {line}",
            flush=True,
        )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("set", choices=SETS)
    parser.add_argument("outdir")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only parse every line (CPU dry run)")
    mode.add_argument("--list", action="store_true", help="print the lines")
    args = parser.parse_args(argv)
    lines = command_lines(args.set, args.outdir)
    if args.list:
        print("\n".join(lines))
        return 0
    if args.check:
        return 1 if check(lines) else 0
    return run(lines)


if __name__ == "__main__":
    sys.exit(main())
