"""``llm-speed doctor``: what this machine has and what llm-speed will run on it.

Every answer comes from trying: the SDPA backends are each run once on a tiny input, and each op of the op
table (:mod:`llm_speed.ops`) that has a probe is called once on a tiny input while the Triton launch counters
(``llm_speed.core.runtime``) show whether a Triton kernel ran or a PyTorch fallback did. The command exits 1
when any probe fails, so a CI job can run it as a smoke test.
"""

from __future__ import annotations

import argparse
import platform
import sys
import warnings
from typing import TYPE_CHECKING, Any

from llm_speed import _cli, ops

if TYPE_CHECKING:  # torch is imported when the command runs, not when the parser is built
    import torch
    from rich.console import Console

# Tiny SDPA probe: enough to try every backend once.
_PROBE_SEQ = ops.PROBE_SEQ
_PROBE_HEAD_DIM = ops.PROBE_HEAD_DIM
FAILS = "fails"  # how a failing probe's "runs" entry starts


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``llm-speed doctor``."""
    parser = subparsers.add_parser(
        "doctor", help="GPU, versions, SDPA backends and what llm-speed dispatches to"
    )
    _cli.add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--output", metavar="FILE.json", help="also write the report as JSON to this file")
    parser.set_defaults(func=run_doctor_command)


def gpu_info() -> dict[str, Any]:
    """The visible GPU (name, compute capability, memory, spec-table entry), or why there is none."""
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "reason": "no CUDA device visible to torch " + _cuda_build_note()}
    from llm_speed.core.gpus import detect_gpu, live_device_properties

    props = live_device_properties() or {}
    spec = detect_gpu()
    return {
        "available": True,
        "name": props.get("name"),
        "compute_capability": ".".join(str(part) for part in props.get("compute_capability", ())),
        "sm_count": props.get("sm_count"),
        "memory_gb": props.get("memory_gb"),
        "l2_cache_mb": props.get("l2_cache_mb"),
        "device_count": torch.cuda.device_count(),
        "spec_table_id": spec.id if spec is not None else None,
    }


def _cuda_build_note() -> str:
    import torch

    if torch.version.cuda is None:
        return "(this torch is a CPU-only build)"
    return f"(torch built with CUDA {torch.version.cuda})"


def sdpa_backends(device: torch.device) -> dict[str, dict[str, Any]]:
    """Each SDPA backend run once on a tiny causal input: usable, or the reason it refused."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, _PROBE_SEQ, _PROBE_HEAD_DIM, device=device, dtype=dtype)
    result = {}
    for label, backend in (
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                result[label] = {"usable": True, "reason": None}
            except RuntimeError as error:
                details = [str(w.message).splitlines()[0] for w in caught if str(w.message).strip()]
                reason = str(error).splitlines()[0]
                if details:
                    reason += " (" + "; ".join(dict.fromkeys(details)) + ")"
                elif device.type == "cpu":
                    # torch refuses CUDA-only backends on CPU tensors without saying why.
                    reason = f"torch has no CPU kernel for this backend (it said: {reason})"
                result[label] = {"usable": False, "reason": reason}
    return result


def dispatch(device: torch.device) -> dict[str, dict[str, Any]]:
    """For each probed op of the table, what actually ran on ``device``: which Triton kernels (compiled or
    interpreted), or a PyTorch implementation when no Triton kernel was launched."""
    from llm_speed.core import runtime

    result = {}
    for op in ops.probes():
        before = runtime.launch_counts()
        try:
            op.run_probe(device)
        except Exception as error:  # a failing op is reported, and the others still checked
            result[op.title] = {
                "runs": f"{FAILS}: {type(error).__name__}: {str(error).splitlines()[0]}",
                "kernels": [],
            }
            continue
        launched = sorted((runtime.launch_counts() - before).keys())
        if not launched and op.plain_pytorch:
            runs = "PyTorch (plain ops, by design)"
        elif not launched:
            runs = "PyTorch fallback (no Triton kernel launched)"
        elif runtime.INTERPRETED:
            runs = "Triton interpreter"
        else:
            runs = "Triton compiled"
        result[op.title] = {"runs": runs, "kernels": launched}
    return result


def failed_probes(info: dict[str, Any]) -> list[str]:
    """The ops whose probe failed in a :func:`doctor_report`."""
    return [name for name, entry in info["dispatch"].items() if entry["runs"].startswith(FAILS)]


def doctor_report(device: torch.device) -> dict[str, Any]:
    """Everything ``llm-speed doctor`` shows, as plain values."""
    import torch
    import triton

    from llm_speed import __version__
    from llm_speed.core import runtime

    return {
        "llm_speed_version": __version__,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "triton_version": triton.__version__,
        "triton_interpret": runtime.INTERPRETED,
        "device": str(device),
        "gpu": gpu_info(),
        "sdpa_backends": sdpa_backends(device),
        "flash_attn_installed": _flash_attn_installed(),
        "dispatch": dispatch(device),
        "launch_policy": launch_policy(),
    }


def launch_policy() -> dict[str, Any]:
    """The launch policy in force (``LLM_SPEED_POLICY`` names a candidate, else the shipped one) and each
    launch choice's shipped value with its GPU proof, or "unproven" (then off as shipped)."""
    from llm_speed.core import policy

    current = policy.current_policy()
    name = next((c.name for c in policy.CANDIDATES.values() if c.policy == current), None)
    choices = []
    for choice, shipped, proof in policy.proof_lines():
        in_force = repr(getattr(current, choice)) if choice in policy.PROOFS else "-"
        choices.append({"choice": choice, "shipped": shipped, "in_force": in_force, "proof": proof})
    return {"policy": "shipped" if current == policy.SHIPPED else name or "custom", "choices": choices}


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def print_doctor(info: dict[str, Any], console: Console | None = None) -> None:
    """The report as four short tables."""
    from llm_speed._output import print_table

    console = console or _cli.console()
    gpu = info["gpu"]
    if gpu["available"]:
        gpu_text = f"{gpu['name']} (compute capability {gpu['compute_capability']}, {gpu['sm_count']} SMs)"
        spec_text = gpu["spec_table_id"] or "not in the spec table: no roofline predictions"
    else:
        gpu_text, spec_text = f"none — {gpu['reason']}", "—"
    mode = "on (Triton kernels run in the interpreter)" if info["triton_interpret"] else "off"
    print_table(
        "llm-speed doctor",
        ["item", "value"],
        [
            ["llm-speed", info["llm_speed_version"]],
            ["python", info["python_version"]],
            ["torch", f"{info['torch_version']} (CUDA {info['torch_cuda_version'] or 'none'})"],
            ["triton", info["triton_version"]],
            ["GPU", gpu_text],
            ["GPU spec entry", spec_text],
            ["TRITON_INTERPRET", mode],
            ["flash_attn package", "installed" if info["flash_attn_installed"] else "not installed"],
            ["probed on", info["device"]],
        ],
        console=console,
    )
    print_table(
        "torch SDPA backends",
        ["backend", "usable", "why not"],
        [[name, entry["usable"], entry["reason"]] for name, entry in info["sdpa_backends"].items()],
        console=console,
    )
    print_table(
        "What llm-speed runs here",
        ["op", "runs", "Triton kernels launched"],
        [[op, entry["runs"], ", ".join(entry["kernels"]) or None] for op, entry in info["dispatch"].items()],
        console=console,
    )
    launch = info["launch_policy"]
    print_table(
        f"Launch choices (policy: {launch['policy']})",
        ["choice", "shipped", "in force", "GPU proof"],
        [[c["choice"], c["shipped"], c["in_force"], c["proof"]] for c in launch["choices"]],
        console=console,
    )


def run_doctor_command(args: argparse.Namespace) -> int:
    """``llm-speed doctor``: exit 0, or 1 when any op's probe failed."""
    from llm_speed._output import dump_json, prepare_output_path

    device = _cli.resolve_device(args.device)  # a device that is not here: refused before a folder is made
    if args.output:
        prepare_output_path(args.output, argument="--output")
    info = doctor_report(device)
    if args.output:
        dump_json(info, args.output)
    if args.json:
        dump_json(info)
    else:
        print_doctor(info, _cli.console())
    failed = failed_probes(info)
    if failed:
        print(f"llm-speed doctor: failing ops: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
