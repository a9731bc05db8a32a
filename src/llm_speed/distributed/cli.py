"""``llm-speed ring-plan``: what ring attention costs for a zoo model, a sequence length and a world size."""

from __future__ import annotations

import argparse

from llm_speed._cli import non_negative_float, positive_int
from llm_speed._output import dump_json, print_table
from llm_speed.core.sequence_split import LAYOUTS
from llm_speed.perf.context_parallel import ring_attention_plan
from llm_speed.perf.distributed import LINKS

MB = 1e6
MS = 1e3


def _ring_plan(args: argparse.Namespace) -> int:
    plan = ring_attention_plan(
        args.model,
        seq_len=args.seq_len,
        cp=args.world_size,
        gpu=args.gpu,
        link=args.link,
        micro_batch_size=args.batch_size,
        dtype=args.dtype,
        layout=args.layout,
        causal=not args.no_causal,
        latency_s=args.latency_us * 1e-6,
    )
    if args.json:
        dump_json(plan)
        return 0
    columns = ["phase", "transfers", "MB/step", "MB/layer", "transfer ms", "block GFLOP", "block ms"]
    columns.append("hidden")
    rows = [
        [
            "forward",
            plan.forward_steps,
            plan.kv_bytes_per_step / MB,
            plan.forward_bytes_per_layer / MB,
            plan.forward_transfer_s * MS,
            plan.forward_block_flops / 1e9,
            plan.forward_block_s * MS,
            plan.forward_hidden,
        ],
        [
            "backward",
            f"{plan.forward_steps} K/V + {plan.cp if plan.cp > 1 else 0} dK/dV",
            (plan.kv_bytes_per_step + plan.dkv_bytes_per_step) / MB,
            plan.backward_bytes_per_layer / MB,
            plan.backward_transfer_s * MS,
            plan.backward_block_flops / 1e9,
            plan.backward_block_s * MS,
            plan.backward_hidden,
        ],
    ]
    print_table(
        f"Ring attention: {plan.model}, {plan.seq_len} tokens on {plan.cp} x {plan.gpu} over {plan.link} "
        f"({plan.layout}, {'causal' if plan.causal else 'not causal'}, {plan.dtype}, batch "
        f"{plan.micro_batch_size})",
        columns,
        rows,
        caption=(
            f"Per rank and attention layer; {plan.tokens_per_rank} tokens per rank; link "
            f"{plan.link_bytes_per_s / 1e9:g} GB/s one way. MB/step: what one rank sends at each step "
            "(dK/dV as float32). Block: the busiest rank's kernel at one step, roofline floor of the "
            "matmuls llm-speed's kernels execute. hidden: transfer <= block. Whole model "
            f"({plan.num_layers} layers): {plan.forward_bytes_per_rank / 1e9:.3g} GB forward, "
            f"{plan.backward_bytes_per_rank / 1e9:.3g} GB backward per rank."
        ),
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``ring-plan``."""
    parser = subparsers.add_parser(
        "ring-plan", help="context-parallel ring attention: bytes per rank per step, compute per block"
    )
    parser.add_argument("--model", required=True, help="zoo id (see `llm-speed models`) or config.json path")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens of the whole sequence")
    parser.add_argument("--world-size", type=positive_int, required=True,
                        help="ranks in the ring (context parallel)")
    parser.add_argument("--gpu", required=True, help="GPU id (see `llm-speed gpus`)")
    parser.add_argument("--link", default="nvlink", choices=LINKS)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                        help="Q/K/V dtype (what the ring's flash kernels take; default bf16)")  # fmt: skip
    parser.add_argument("--layout", default="zigzag", choices=LAYOUTS)
    parser.add_argument("--no-causal", action="store_true", help="bidirectional attention (default: causal)")
    parser.add_argument("--latency-us", type=non_negative_float, default=0.0,
                        help="fixed cost of one transfer, in us")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_ring_plan)
