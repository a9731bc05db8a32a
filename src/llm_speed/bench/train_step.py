"""``llm-speed bench train-step``: tokens/s and peak memory of a training step of a Hugging Face Llama-style
model, unpatched and patched by :func:`llm_speed.integrations.transformers.apply`, in the same run.

The model is built from a zoo entry (``llm_speed.perf.models``) or a ``config.json`` as a transformers
``LlamaConfig`` (dense, SwiGLU MLP; ``--layers`` keeps the first N layers to fit a device), random
weights, no download. A step is forward with labels, backward and a plain SGD update (no optimizer state in
the memory figures). On the CPU the times are of the interpreter or the PyTorch fallback and say
nothing about a GPU; peak memory is measured on CUDA only. Needs ``pip install llm-speed[hf]``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from llm_speed.bench import report, timing
from llm_speed.bench.ops import finish, start, unavailable_reason
from llm_speed.bench.options import OPS_DTYPES as DTYPES
from llm_speed.bench.options import TRAIN_STEP_VARIANTS as VARIANTS
from llm_speed.perf.models import ModelConfig, resolve_model


@dataclasses.dataclass
class StepRow:
    variant: str
    tokens: int
    median_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    loss: float | None = None
    unavailable: str | None = None


def llama_config(model: ModelConfig, layers: int | None):
    """A transformers LlamaConfig with ``model``'s sizes (ValueError for MoE, MLA or non-SwiGLU models)."""
    import transformers

    if (
        model.num_experts
        or model.kv_lora_rank
        or not model.gated_mlp
        or model.activation not in ("silu", "swish")
    ):
        raise ValueError(f"model {model.name!r}: train-step builds dense SwiGLU (Llama-style) models only")
    return transformers.LlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=layers or model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings, attention_bias=model.attention_bias,
        tie_word_embeddings=model.tie_embeddings,
    )  # fmt: skip


def run_train_step(
    model: ModelConfig | str, *, layers: int | None, batch: int, seq: int, dtype: str, device: torch.device,
    warmup: int, iterations: int, variants=VARIANTS,
) -> list[StepRow]:  # fmt: skip
    """Time a training step of each variant on the same weights and tokens; returns one StepRow each."""
    import transformers

    from llm_speed.integrations.transformers import apply

    config = llama_config(resolve_model(model), layers)
    torch_dt = report.torch_dtype(dtype, DTYPES)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch_dt)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    rows = []
    for variant in variants:
        row = StepRow(variant, batch * seq)
        rows.append(row)
        try:
            model_v = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch_dt)
            model_v.load_state_dict(base.state_dict())
            if variant == "llm_speed":
                apply(model_v)
            optimizer = torch.optim.SGD(model_v.parameters(), lr=1e-6)

            def step(m=model_v, opt=optimizer):
                opt.zero_grad(set_to_none=True)
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                return loss.detach()

            t = timing.measure(step, warmup=warmup, iterations=iterations, device=device)
            memory = timing.peak_memory(step, device)
            row.loss = float(step())
        except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
            row.unavailable = unavailable_reason(error)
            continue
        row.median_ms = t.median_ms
        row.tokens_per_s = batch * seq / (t.median_ms * 1e-3)
        row.peak_mib = report.mib(memory.peak_bytes)
    return rows


def run_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    device = start(args)
    gpu_run = device.type == "cuda"
    settings: dict[str, Any] = dict(
        layers=args.layers, batch=args.batch, seq=args.seq or (2048 if gpu_run else 16), dtype=args.dtype,
        device=device, warmup=args.warmup if args.warmup is not None else (3 if gpu_run else 1),
        iterations=args.iterations or (10 if gpu_run else 2),
    )  # fmt: skip
    rows = run_train_step(args.model, **settings)
    device_name = report.environment_device_name(device)
    table = Table(title=f"training step, {args.model}, {args.dtype}, {device_name}")
    for column in ("variant", "tokens", "median ms", "tokens/s", "peak MiB", "loss"):
        table.add_column(column)
    for row in rows:
        if row.unavailable:
            table.add_row(row.variant, str(row.tokens), f"unavailable: {row.unavailable}", "", "", "")
            continue
        peak = f"{row.peak_mib:.0f}" if row.peak_mib is not None else "-"
        table.add_row(row.variant, str(row.tokens), f"{row.median_ms:.1f}", f"{row.tokens_per_s:.0f}", peak,
                      f"{row.loss:.4f}")  # fmt: skip
    settings["device"] = str(device)
    payload = {"model": args.model, "settings": settings, "rows": [dataclasses.asdict(r) for r in rows]}
    finish(table, device, payload, args.output)
    return 0 if all(r.unavailable is None for r in rows) else 1
