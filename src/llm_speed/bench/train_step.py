"""``llm-speed bench train-step``: tokens/s, peak memory and loss of a training step of a Hugging Face
causal LM of any family :func:`llm_speed.integrations.transformers.apply` patches, unpatched
(``transformers``), patched by ``apply`` (``llm_speed``) and patched by Liger-Kernel's
``apply_liger_kernel_to_<family>`` (``liger``, when installed and Liger has that family), on the same weights
and tokens in one run.

The model is built from a zoo entry (``llm_speed.perf.models``) or a ``config.json``: the sizes of that
entry in the layers of ``--family`` (:data:`FAMILIES`; by default the config.json's ``model_type``, else
``deepseek_v3`` for an MLA model, ``mixtral`` for another MoE one and ``llama`` for a dense one), as that
family's transformers config (``--layers`` keeps the first N layers to fit a device), random weights, no
download. MoE families need a model with experts (and DeepSeek-V3 MLA ranks), dense ones a dense model.

A step is forward with labels, backward and a plain SGD update (no optimizer state in the
memory figures). Each row's loss is the loss of the starting weights (every variant starts from a copy of
the same model), and ``loss_difference`` is its difference from the unpatched model's. FLOPs are the model
FLOPs of a causal forward + backward (:func:`llm_speed.perf.mfu.training_flops_per_token`); bytes are the
parameter traffic only (read by the forward and the backward, gradient written, SGD reading both and
writing the weights: ``5 P b``), a lower bound, so no roofline time is predicted for a whole step.

Liger's patch replaces functions and classes of the family's ``modeling_<family>`` module for every model;
they are put back when its row is done. On the CPU the times are of the interpreter or the PyTorch fallback
and say nothing about a GPU; peak memory is measured on CUDA only. The device holds one variant's model at a
time (the starting weights wait in host memory), and each row also has its peak beyond the weights and their
gradients (``peak_beyond_parameters_bytes``: activations, logits and temporaries). Needs
``pip install llm-speed[hf]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

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
    family: str
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

    # No roofline floor nor calibrated prediction of a whole step (NO_PREDICTION, in prediction_reason): those
    # fields would be null whatever the input, so its JSON and CSV rows leave them out.
    NOT_WRITTEN: ClassVar[tuple[str, ...]] = (
        *Measurement.NOT_WRITTEN, "predicted_ms", "predicted_bound", "measured_over_predicted",
        "prediction_ms", "prediction_bound", "prediction_error", "prediction_calibrated",
    )  # fmt: skip
    tokens: int
    tokens_per_s: float | None = None
    # peak_memory_bytes minus the weights and their gradients (which every variant holds once its backward
    # is done): the activations, logits and temporaries at the step's peak, what a patch can change
    peak_beyond_parameters_bytes: int | None = None
    loss: float | None = None  # at the starting weights, shared by every variant
    loss_difference: float | None = None  # loss - the unpatched model's loss


# --family: each family's transformers config class (the families llm_speed.integrations.transformers patches)
FAMILIES = {
    "llama": "LlamaConfig", "mistral": "MistralConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig",
    "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig", "phi3": "Phi3Config",
    "olmo2": "Olmo2Config", "granite": "GraniteConfig", "deepseek_v3": "DeepseekV3Config",
}  # fmt: skip
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
GEGLU_FAMILIES = ("gemma", "gemma2", "gemma3_text")


def default_family(model: ModelConfig, model_arg: str) -> str:
    """The family a model is built as without ``--family``: a config.json's ``model_type`` when it is one of
    :data:`FAMILIES`, else ``deepseek_v3`` for MLA, ``mixtral`` for other MoE models, ``llama`` otherwise."""
    import json
    from pathlib import Path

    path = Path(model_arg)
    file = path / "config.json" if path.is_dir() else path
    if file.is_file():
        model_type = json.loads(file.read_text()).get("model_type")
        if model_type in FAMILIES:
            return model_type
    if model.kv_lora_rank:
        return "deepseek_v3"
    return "mixtral" if model.num_experts else "llama"


def family_config(model: ModelConfig, family: str, layers: int | None, *, model_arg: str | None = None):
    """The transformers config of ``family`` with ``model``'s sizes. ValueError when the two do not fit: a
    gated MLP is needed (SwiGLU; the Gemma families use their GeGLU), MoE families need experts, DeepSeek-V3
    MLA ranks, dense families a dense model. ``model_arg``: the ``--model`` given, named in the errors (a
    config.json's model is named after its folder)."""
    import transformers

    report.check_choice("family", family, tuple(FAMILIES))
    # at the command line: the flag the error is about first, then the --model given
    named = f"--model {model_arg}" if model_arg is not None else f"model {model.name!r}"
    model_flag, family_flag = ("model: ", "family: ") if model_arg is not None else ("", "")
    if not model.gated_mlp or (family not in GEGLU_FAMILIES and model.activation not in ("silu", "swish")):
        raise ValueError(f"{model_flag}{named}: train-step builds gated (SwiGLU or Gemma's GeGLU) MLPs only")
    if (family in MOE_FAMILIES) != bool(model.num_experts):
        kind = "an MoE" if model.num_experts else "a dense"
        raise ValueError(f"{family_flag}{named} is {kind} model; family {family!r} needs "
                         f"{'an MoE' if family in MOE_FAMILIES else 'a dense'} one")  # fmt: skip
    if (family == "deepseek_v3") != bool(model.kv_lora_rank):
        raise ValueError(f"{family_flag}{named}: MLA (kv_lora_rank) goes with family 'deepseek_v3' only")
    kw = dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
        num_hidden_layers=layers or model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
        max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=model.tie_embeddings,
    )  # fmt: skip
    if family not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3", "phi3"):
        kw["attention_bias"] = model.attention_bias
    if family in ("mistral", "mixtral", "phi3") or (family.startswith("qwen") and model.sliding_window):
        kw["sliding_window"] = model.sliding_window
    experts = dict(num_experts_per_tok=model.experts_per_token,
                   moe_intermediate_size=model.moe_intermediate_size)  # fmt: skip
    if family == "mixtral":
        kw.update(num_local_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
                  intermediate_size=model.moe_intermediate_size)  # fmt: skip
    elif family in ("qwen2_moe", "qwen3_moe"):
        dense = list(range(model.first_dense_layers))
        kw.update(experts, num_experts=model.num_experts, mlp_only_layers=dense)
        if family == "qwen2_moe":
            shared = model.moe_intermediate_size * max(1, model.num_shared_experts)
            kw["shared_expert_intermediate_size"] = shared
    elif family == "deepseek_v3":
        del kw["head_dim"]
        kw.update(experts, n_routed_experts=model.num_experts, n_shared_experts=model.num_shared_experts,
                  first_k_dense_replace=model.first_dense_layers, kv_lora_rank=model.kv_lora_rank,
                  q_lora_rank=model.q_lora_rank or None, qk_rope_head_dim=model.qk_rope_head_dim,
                  qk_nope_head_dim=model.qk_nope_head_dim, v_head_dim=model.v_head_dim, n_group=1,
                  topk_group=1)  # fmt: skip
    return getattr(transformers, FAMILIES[family])(**kw)


def train_step_settings(args: argparse.Namespace, device: torch.device) -> TrainStepSettings:
    """Settings from parsed flags, defaults filled for the device; the model is resolved (and refused when it
    is not a dense SwiGLU model) before any work."""
    import importlib.util

    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    if importlib.util.find_spec("transformers") is None:
        raise ValueError("bench train-step needs the transformers package: pip install llm-speed[hf]")
    config = resolve_model(args.model)
    family = args.family or default_family(config, args.model)
    family_config(config, family, args.layers, model_arg=args.model)  # ValueError now for one it cannot build
    if args.layers is not None and args.layers > config.num_layers:
        raise ValueError(f"layers: {args.model} has {config.num_layers} layers, got {args.layers}")
    settings = TrainStepSettings(
        model=args.model,
        family=family,
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


def _modeling(family: str):
    import importlib

    name = "gemma3" if family == "gemma3_text" else family
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@contextlib.contextmanager
def _family_module_restored(family: str) -> Iterator[None]:
    """Put back what a global patch (Liger's) changes in the family's modeling module and its classes'
    forwards."""
    module = _modeling(family)
    saved = dict(vars(module))
    classes = [cls for cls in saved.values() if isinstance(cls, type) and "forward" in vars(cls)]
    forwards = {cls: cls.forward for cls in classes}
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
        for cls, forward in forwards.items():
            cls.forward = forward


def unavailable_reason(impl: str, device: torch.device, family: str) -> str | None:
    """Why variant ``impl`` cannot run here, known before any model is built (Liger missing, or without a
    patch for ``family``), or None."""
    if impl != "liger":
        return None
    if (reason := liger_unavailable(device)) is not None:
        return reason
    if liger_patch(family) is None:
        return f"Liger-Kernel has no apply_liger_kernel_to_{family}"
    return None


def liger_patch(family: str):
    """Liger-Kernel's ``apply_liger_kernel_to_<family>`` (Gemma-3 text: ``..._gemma3_text``), or None where
    Liger has none (or is not installed)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    return getattr(liger, f"apply_liger_kernel_to_{family}", None)


def _patch(variant: str, model, family: str) -> None:
    if variant == "llm_speed":
        from llm_speed.integrations.transformers import apply

        apply(model)
    elif variant == "liger":
        liger_patch(family)(model=model)


def first_layers(config: ModelConfig, layers: int | None) -> ModelConfig:
    """The model's first ``layers`` layers (None: all), as ``--layers`` builds it: DeepSeek-style dense layers
    come first (``first_k_dense_replace``), so keeping no more than them leaves a dense model."""
    kept = layers or config.num_layers
    if config.is_moe and kept <= config.first_dense_layers:
        return dataclasses.replace(
            config, num_layers=kept, num_experts=0, experts_per_token=0, moe_intermediate_size=0,
            num_shared_experts=0, first_dense_layers=0, router_bias=False,
        )  # fmt: skip
    return dataclasses.replace(config, num_layers=kept)


def host_memory_floor(settings: TrainStepSettings, layers: int | None = None) -> int:
    """Bytes of host memory a run holds at least: the starting weights kept there between variants, and on a
    CPU also the variant's model and its gradients (``layers``: instead of the settings')."""
    from llm_speed.perf.models import param_count

    params = param_count(first_layers(resolve_model(settings.model), layers or settings.layers)).total
    copies = 3 if torch.device(settings.device).type == "cpu" else 1
    return copies * params * report.TORCH_DTYPES[settings.dtype].itemsize


def memory_refusal(settings: TrainStepSettings, available: int | None) -> str | None:
    """Why the run cannot start with ``available`` bytes of host memory (None when it can), with the most
    layers that fit: the system kills a process that takes more, every result with it."""
    need = host_memory_floor(settings)
    if available is None or need <= available:
        return None
    layers = settings.layers or resolve_model(settings.model).num_layers
    fits = next((n for n in range(layers - 1, 0, -1) if host_memory_floor(settings, n) <= available), None)
    hint = f"give --layers {fits} or fewer" if fits else "even one layer does not fit; give a smaller --model"
    return (
        f"model: {settings.model} with {layers} layers needs at least {report.bytes_text(need)} of host "
        f"memory (its weights, and on a CPU the model and its gradients), {report.bytes_text(available)} "
        f"available; {hint}"
    )


def _costs(config: ModelConfig, settings: TrainStepSettings, params: int) -> tuple[float, float]:
    from llm_speed.perf.mfu import training_flops_per_token

    layered = first_layers(config, settings.layers)
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
    hf_config = family_config(config, settings.family, settings.layers)
    torch_dt = report.TORCH_DTYPES[settings.dtype]
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: a CPU init of billions of weights takes minutes
        base = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch_dt)
    # Kept in host memory between variants: on the device this spare copy (2.97 GB for two layers of
    # Llama-3-8B) was counted in every variant's peak memory.
    base = base.to("cpu")
    ids = torch.randint(0, hf_config.vocab_size, (settings.batch, settings.seq), device=device)
    parameters = sum(p.numel() for p in base.parameters())
    flops, moved = _costs(config, settings, parameters)
    # every parameter requires grad: at the end of a backward, weights and gradients are both allocated
    held = 2 * parameters * torch_dt.itemsize
    tokens = settings.batch * settings.seq
    layers = hf_config.num_hidden_layers
    case = f"{settings.model} ({settings.family}) layers={layers} batch={settings.batch} seq={settings.seq}"
    liger_reason = unavailable_reason("liger", device, settings.family) if "liger" in settings.impls else None
    rows: list[StepMeasurement] = []
    progress = report.progress(len(settings.impls), "train-step") if show_progress else None
    with progress if progress is not None else contextlib.nullcontext(None) as advance:
        for variant in settings.impls:
            row = StepMeasurement(
                case=case, impl=variant, dtype=settings.dtype, available=False, flops=flops,
                bytes_moved=moved, tokens=tokens,
            )  # fmt: skip
            if variant == "liger" and liger_reason is not None:
                row.reason = liger_reason
            else:

                def build(variant=variant, row=row) -> Callable[[], Any]:
                    model = copy.deepcopy(base).to(device)
                    _patch(variant, model, settings.family)
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

                scope = (functools.partial(_family_module_restored, settings.family) if variant == "liger"
                         else contextlib.nullcontext)  # fmt: skip
                report.run_measurement(
                    row, build, device=device, warmup=settings.warmup, iterations=settings.iterations,
                    min_time_s=settings.min_time_s, context=scope,
                )  # fmt: skip
                if not row.available:
                    row.loss = None
                elif row.peak_memory_bytes is not None:
                    row.peak_beyond_parameters_bytes = row.peak_memory_bytes - held
                # a variant whose patch made reference cycles (methods bound on instances) holds its model
                # until the cycle collector runs: freed here, not counted in the next variant's peak
                gc.collect()
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
            report.mib(row.peak_beyond_parameters_bytes),
            *report.common_cells(row),
        ]
        for row in rows
        if row.available
    ]
    caption = (
        f"{rows[0].case if rows else settings.model}, dtype={report.TORCH_DTYPES[settings.dtype]}, "
        f"device={report.environment_device_name(device)}; loss at the starting weights"
    )
    columns = ["variant", "tokens", "tokens/s", "loss", "loss - transformers",
               "peak beyond weights+grads MiB", *report.COMMON_COLUMNS]  # fmt: skip
    report.print_rows("Training step", columns, table, caption=caption, console=console)
    report.print_unavailable(rows, console)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print(f"note: {NO_PREDICTION}", highlight=False, markup=False)
