"""``llm-speed bench train-step``: tokens/s, peak memory and loss of a training step of a Hugging Face
Llama-style model, unpatched (``transformers``), patched by :func:`llm_speed.integrations.transformers.apply`
(``llm_speed``) and patched by Liger-Kernel's ``apply_liger_kernel_to_llama`` (``liger``, when installed), on
the same weights and tokens in one run.

The model is built from a zoo entry (``llm_speed.perf.models``) or a ``config.json`` as a transformers
``LlamaConfig`` (dense, SwiGLU MLP; ``--layers`` keeps the first N layers to fit a device), random weights,
no download. A step is forward with labels, backward and a plain SGD update (no optimizer state in the
memory figures). Each row's loss is the loss of the starting weights (every variant starts from a copy of
the same model), and ``loss_difference`` is its difference from the unpatched model's. FLOPs are the model
FLOPs of a causal forward + backward (:func:`llm_speed.perf.mfu.training_flops_per_token`); bytes are the
parameter traffic only (read by the forward and the backward, gradient written, SGD reading both and
writing the weights: ``5 P b``), a lower bound, so no roofline time is predicted for a whole step.

Liger's patch replaces functions and classes of ``transformers.models.llama.modeling_llama`` for every model;
they are put back when its row is done. On the CPU the times are of the interpreter or the PyTorch fallback
and say nothing about a GPU; peak memory is measured on CUDA only. Needs ``pip install llm-speed[hf]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from rich.console import Console

from llm_speed.bench import report
from llm_speed.bench.ops import liger_unavailable
from llm_speed.bench.options import OPS_DTYPES as DTYPES
from llm_speed.bench.options import OPS_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.options import TRAIN_STEP_VARIANTS as VARIANTS
from llm_speed.bench.report import Measurement
from llm_speed.perf.models import ModelConfig, resolve_model

GPU_DEFAULTS = {"seq": 2048, "dtype": "bf16", "warmup": 3, "iterations": 10, "min_time": 0.0}
CPU_DEFAULTS = {"seq": 16, "dtype": "fp32", "warmup": 1, "iterations": 2, "min_time": 0.0}
NO_PREDICTION = "no roofline prediction for a whole training step (its bytes are a lower bound)"


@dataclasses.dataclass(frozen=True)
class TrainStepSettings:
    """One ``bench train-step`` run."""

    model: str
    layers: int | None
    batch: int
    seq: int
    dtype: str
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    min_time_s: float
    device: str


@dataclasses.dataclass(kw_only=True)
class StepMeasurement(Measurement):
    """A :class:`Measurement` of one variant's training step."""

    tokens: int
    tokens_per_s: float | None = None
    loss: float | None = None  # at the starting weights, shared by every variant
    loss_difference: float | None = None  # loss - the unpatched model's loss


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


def train_step_settings(args: argparse.Namespace, device: torch.device) -> TrainStepSettings:
    """Settings from parsed flags, defaults filled for the device; the model is resolved (and refused when it
    is not a dense SwiGLU model) before any work."""
    import importlib.util

    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    if importlib.util.find_spec("transformers") is None:
        raise ValueError("model: bench train-step needs transformers (pip install llm-speed[hf])")
    config = resolve_model(args.model)
    llama_config(config, args.layers)  # ValueError now for a model it cannot build
    if args.layers is not None and args.layers > config.num_layers:
        raise ValueError(f"layers: {args.model} has {config.num_layers} layers, got {args.layers}")
    settings = TrainStepSettings(
        model=args.model,
        layers=args.layers,
        batch=args.batch,
        seq=pick("seq"),
        dtype=pick("dtype"),
        impls=tuple(args.impl or VARIANTS),
        warmup=pick("warmup"),
        iterations=pick("iterations"),
        min_time_s=pick("min_time"),
        device=str(device),
    )
    report.check_counts(settings, "batch", "seq")
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choices("impl", settings.impls, VARIANTS)
    return settings


@contextlib.contextmanager
def _llama_module_restored() -> Iterator[None]:
    """Put back what a global patch (Liger's) changes in transformers' Llama module and causal-LM class."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    forward = modeling_llama.LlamaForCausalLM.forward
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(modeling_llama).get(name) is not value:
                setattr(modeling_llama, name, value)
        modeling_llama.LlamaForCausalLM.forward = forward


def _patch(variant: str, model) -> None:
    if variant == "llm_speed":
        from llm_speed.integrations.transformers import apply

        apply(model)
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)


def _costs(config: ModelConfig, settings: TrainStepSettings, params: int) -> tuple[float, float]:
    from llm_speed.perf.mfu import training_flops_per_token

    layered = dataclasses.replace(config, num_layers=settings.layers or config.num_layers)
    tokens = settings.batch * settings.seq
    flops = training_flops_per_token(layered, settings.seq, "causal") * tokens
    return flops, 5.0 * params * report.TORCH_DTYPES[settings.dtype].itemsize


def run_train_step(
    settings: TrainStepSettings,
    *,
    show_progress: bool = True,
    on_case: Callable[[list[StepMeasurement]], None] | None = None,
) -> list[StepMeasurement]:
    """Time a training step of each variant on the same weights and tokens; ``on_case(rows)`` after each."""
    import transformers

    device = torch.device(settings.device)
    config = resolve_model(settings.model)
    hf_config = llama_config(config, settings.layers)
    torch_dt = report.TORCH_DTYPES[settings.dtype]
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: a CPU init of billions of weights takes minutes
        base = transformers.LlamaForCausalLM(hf_config).to(torch_dt)
    ids = torch.randint(0, hf_config.vocab_size, (settings.batch, settings.seq), device=device)
    flops, moved = _costs(config, settings, sum(p.numel() for p in base.parameters()))
    tokens = settings.batch * settings.seq
    case = f"{settings.model} layers={hf_config.num_hidden_layers} batch={settings.batch} seq={settings.seq}"
    liger_reason = liger_unavailable(device) if "liger" in settings.impls else None
    rows: list[StepMeasurement] = []
    progress = report.progress(len(settings.impls), "train-step") if show_progress else None
    with progress if progress is not None else contextlib.nullcontext(None) as advance:
        for variant in settings.impls:
            row = StepMeasurement(
                case=case, impl=variant, available=False, flops=flops, bytes_moved=moved, tokens=tokens
            )
            if variant == "liger" and liger_reason is not None:
                row.reason = liger_reason
            else:

                def build(variant=variant, row=row) -> Callable[[], Any]:
                    model = copy.deepcopy(base)
                    _patch(variant, model)
                    with torch.no_grad():
                        row.loss = float(model(input_ids=ids, labels=ids).loss)
                    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

                    def step():
                        optimizer.zero_grad(set_to_none=True)
                        loss = model(input_ids=ids, labels=ids).loss
                        loss.backward()
                        optimizer.step()
                        return loss.detach()

                    return step

                scope = _llama_module_restored if variant == "liger" else contextlib.nullcontext
                report.run_measurement(
                    row, build, device=device, warmup=settings.warmup, iterations=settings.iterations,
                    min_time_s=settings.min_time_s, context=scope,
                )  # fmt: skip
                if not row.available:
                    row.loss = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            _fill(rows)
            if on_case is not None:
                on_case(rows)
            if advance is not None:
                advance(variant)
    return rows


def _fill(rows: Sequence[StepMeasurement]) -> None:
    report.add_comparisons(rows, None, None, NO_PREDICTION)
    baseline = next((r.loss for r in rows if r.impl == "transformers" and r.loss is not None), None)
    for row in rows:
        if row.median_ms:
            row.tokens_per_s = row.tokens / (row.median_ms * 1e-3)
        if row.loss is not None and baseline is not None:
            row.loss_difference = row.loss - baseline


def results_payload(settings: TrainStepSettings, rows: Sequence[StepMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes and every variant's row."""
    return report.results_document(
        "train-step",
        settings,
        rows,
        lambda row: row.case,
        TRITON_IMPLS,
    )


def print_train_step(settings: TrainStepSettings, rows: Sequence[StepMeasurement], console: Console) -> None:
    """One table of every variant that ran, then what did not run and the notes."""
    device = torch.device(settings.device)
    table = [
        [
            row.impl,
            row.tokens,
            f"{row.tokens_per_s:.4g}" if row.tokens_per_s is not None else None,
            f"{row.loss:.5f}" if row.loss is not None else None,
            f"{row.loss_difference:+.2e}" if row.loss_difference is not None else None,
            *report.common_cells(row),
        ]
        for row in rows
        if row.available
    ]
    caption = (
        f"{rows[0].case if rows else settings.model}, dtype={report.TORCH_DTYPES[settings.dtype]}, "
        f"device={report.environment_device_name(device)}; loss at the starting weights"
    )
    columns = ["variant", "tokens", "tokens/s", "loss", "loss - transformers", *report.COMMON_COLUMNS]
    report.print_rows("Training step", columns, table, caption=caption, console=console)
    report.print_unavailable(rows, console)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print(f"note: {NO_PREDICTION}", highlight=False, markup=False)
