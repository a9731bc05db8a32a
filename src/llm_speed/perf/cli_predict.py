"""``llm-speed predict``: the calibrated time of an op on a GPU, the bound and the terms behind it
(:mod:`llm_speed.perf.predict`), and the refit of the parameters from a results directory
(:mod:`llm_speed.perf.calibrate`). Torch-free: it prints plain text (or JSON) itself.

    llm-speed predict gemm m=4096 n=4096 k=4096 --gpu h100 --implementation cublas
    llm-speed predict flash_attention batch=1 heads_q=16 seq_q=16384 head_dim=128 causal=true --gpu h100
    llm-speed predict --calibrate benchmarks/results/h100-sxm --output my-calibration.json
    llm-speed predict --check benchmarks/results/h100-sxm --points
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from llm_speed._cli import CommandError, positive_int
from llm_speed._output import prepare_output_path
from llm_speed.core.gpus import get_gpu
from llm_speed.perf import calibrate, measurements
from llm_speed.perf._checks import missing_path
from llm_speed.perf._cli_common import DEFAULT_GPU_HELP, default_gpu
from llm_speed.perf.predict import (
    CALIBRATION_ENV,
    CONTEXTS,
    OPS,
    Prediction,
    implementations,
    predict,
)

# A fitted launch cost below a nanosecond is the fit's lower bound, not a time: no launch term is shown.
NO_LAUNCH_TERM_S = 1e-9
DEFAULT_ITERATIONS = 400  # --calibrate's simplex steps per start
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
# predict's boolean problem arguments (perf/prediction: gemm's, attention's). Any other word in their place
# would reach predict as a string (causal=flase); a number, as an int (causal=2).
FLAGS = ("causal", "is_causal", "with_bias", "with_c", "deterministic", "atomic_dq")


def parse_value(text: str) -> Any:
    """A problem value from the command line: true/false, none (None: ``window=128,none``, a window open on
    the right), an int, a float, a comma list of those, else the text itself (a dtype name)."""
    lowered = text.strip().lower()
    if lowered in _TRUE[:3]:
        return True
    if lowered in _FALSE[:3]:
        return False
    if lowered == "none":
        return None
    if "," in text:
        return [parse_value(part) for part in text.split(",") if part.strip()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_problem(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` words -> predict's keyword arguments; ValueError naming a word without ``=`` or a flag
    (``FLAGS``) that is not true/false."""
    problem: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"problem: expected KEY=VALUE, got {item!r} (e.g. m=4096 n=4096 k=4096)")
        key = key.strip().replace("-", "_")
        if key in problem:  # the last one silently won (m=4096 m=8 ran m=8)
            raise ValueError(f"problem: {key} given twice ({item!r} after {key}={problem[key]!r})")
        problem[key] = parse_value(value)
        if key in FLAGS and not isinstance(problem[key], bool):
            raise ValueError(f"{key}: expected true or false (or yes/no, on/off), got {value!r}")
    return problem


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def describe(prediction: Prediction) -> list[str]:
    """A prediction as text: the time and bound, then one line per term."""
    b = prediction.breakdown
    spec = get_gpu(prediction.gpu)
    # Not calibrated: another GPU's parameters, an op or kernel no GPU measured (the source line says which)
    where = "calibrated on its own measurements" if prediction.calibrated else "NOT calibrated: see source"
    lines = [
        f"{prediction.op} on {prediction.gpu}, {prediction.implementation} "
        f"({where}; context {prediction.context})",
        f"  predicted  {_ms(prediction.seconds)}, {prediction.bound}-bound"
        + (
            f"   (roofline floor {_ms(prediction.floor_s)}: {prediction.seconds / prediction.floor_s:.2f}x)"
            if prediction.floor_s
            else ""
        ),
    ]
    if b.compute_s:
        tile = "x".join(str(x) for x in b.tile) if b.tile else "-"
        lines.append(
            f"  compute    {_ms(b.compute_s)}: {b.achievable_flops_per_s / 1e12:.4g} TFLOP/s achieved "
            "over the "
            f"call; tensor-core efficiency {b.tensor_core_efficiency:.2f} of the dense peak; tile {tile}, "
            f"{b.programs} programs = {b.waves:.3g} waves on {spec.sm_count} SMs "
            f"({b.wave_efficiency:.0%} busy)" + (f", split-K {b.split_k}" if b.split_k > 1 else "")
        )
    if b.exp_s:
        lines.append(f"  exp units  {_ms(b.exp_s)} of exponentials per SM (before overlap with the matmuls)")
    if b.dequant_s:
        lines.append(f"  dequant    {_ms(b.dequant_s)} of weight dequantization on the CUDA cores")
    if b.memory_s:
        lines.append(
            f"  memory     {_ms(b.memory_s)}: {b.dram_bytes / 1e6:.4g} MB DRAM at "
            f"{b.achievable_bandwidth / 1e12:.3g} TB/s (minimum {b.bytes_moved / 1e6:.4g} MB); "
            f"the L2 serves {b.l2_bytes / 1e6:.4g} MB of re-reads"
        )
    kernels = f"{b.kernels} kernel{'s' if b.kernels > 1 else ''}"
    host = f"host path {b.host_s * 1e6:.3g} us per call, {b.host_exposed_s * 1e6:.3g} us of it shows"
    if b.latency_s >= NO_LAUNCH_TERM_S:
        launch = f"{b.latency_s * 1e6:.3g} us launch and start/end on the device ({kernels})"
    else:
        launch = f"no launch term ({kernels}: the calibration fitted it to 0 for this op)"
    lines.append(f"  fixed      {launch}; {host}")
    for note in b.notes:
        lines.append(f"  note       {note}")
    lines.append(f"  source     {prediction.source}")
    return lines


_MISSING = re.compile(r"missing problem argument '(\w+)'")


def missing_arguments(
    op: str, gpu: str, problem: dict[str, Any], options: dict[str, Any], error: ValueError
) -> list[str]:
    """Every problem argument ``op`` needs and ``problem`` lacks, from ``error`` (predict's first) on.

    predict stops at the first argument it misses; each later one is found by predicting again with a
    stand-in for those already found (1, or [1] where a list is expected), until the error is about
    something else."""
    missing: list[str] = []
    trial = dict(problem)
    while (match := _MISSING.search(str(error))) and match.group(1) not in trial:
        missing.append(match.group(1))
        for stand_in in (1, [1]):
            trial[match.group(1)] = stand_in
            try:
                predict(op, gpu, **options, **trial)
                return missing
            except ValueError as next_error:
                error = next_error
                break
            except TypeError:  # a list expected: try the next stand-in
                continue
            except Exception:  # noqa: BLE001 (the op refuses the stand-in otherwise: stop with those found)
                return missing
        else:
            break
    return missing


def _predict(args: argparse.Namespace) -> int:
    if args.op is None:
        raise ValueError("predict: give an OP (see --list), or --calibrate DIR / --check DIR")
    problem = parse_problem(args.problem)
    gpu = args.gpu if args.gpu is not None else default_gpu(args.command)
    options = {"implementation": args.implementation, "context": args.context, "build": args.build,
               "calibration": args.calibration}  # fmt: skip
    try:
        prediction = predict(args.op, gpu, **options, **problem)
    except ValueError as error:
        missing = missing_arguments(args.op, gpu, problem, options, error)
        if len(missing) > 1:
            raise ValueError(f"{args.op}: missing problem arguments {', '.join(missing)}") from error
        raise
    except TypeError as error:  # a KEY=VALUE of the wrong kind (m=x): bad input, not a bug
        raise ValueError(f"{args.op}: {error}") from error
    if args.json:
        print(json.dumps(prediction.to_dict(), indent=1))
    else:
        print("\n".join(describe(prediction)))
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = {op: list(implementations(op)) for op in OPS}
    if args.json:
        print(json.dumps({"ops": rows, "contexts": list(CONTEXTS)}, indent=1))
        return 0
    width = max(len(op) for op in rows)
    for op, impls in rows.items():
        print(f"{op:<{width}}  {', '.join(impls)}, vendor")
    return 0


def _summary_lines(entries: dict[str, Any]) -> list[str]:
    lines = [
        f"{'entry':<34} {'train n':>7} {'median':>7} {'worst':>7}  {'held-out n':>10} {'median':>7} "
        f"{'worst':>7}  worst held-out point"
    ]
    for name, fit in entries.items():
        train, held = fit["training"], fit["held_out"]
        lines.append(
            f"{name:<34} {train['points']:>7} {train['median_abs_error']:>7.1%} "
            f"{train['worst_abs_error']:>7.1%}  "
            f"{held['points']:>10} {held['median_abs_error']:>7.1%} {held['worst_abs_error']:>7.1%}  "
            f"{held['worst_point']}"
        )
    return lines


def _calibrate(args: argparse.Namespace) -> int:
    if args.output:
        prepare_output_path(args.output, argument="--output")
    iterations = DEFAULT_ITERATIONS if args.iterations is None else args.iterations
    new = calibrate.calibrate(args.calibrate, base=args.calibration, gpu=args.gpu, iterations=iterations)
    if args.output:
        Path(args.output).write_text(json.dumps(new, indent=1) + "\n")
    if args.json:
        print(json.dumps(new["last_fit"], indent=1))
        return 0
    print(
        f"refitted from {args.calibrate} (training: every point not held out; see llm_speed.perf.calibrate)"
    )
    print("\n".join(_summary_lines(new["last_fit"]["entries"])))
    print(f"written to {args.output}" if args.output else "not written (add --output FILE to keep it)")
    return 0


def check_lines(records: list[dict[str, Any]], points: bool = False) -> list[str]:
    """``--check``'s table: median and worst |error| per implementation, family (``measurements.kind_of``) and
    split; with ``points``, then every point not fitted (held out, or of a kind no fit uses) with its
    measured and predicted time."""
    order = {"training": 0, "held-out": 1, "unfitted": 2}
    groups: dict[tuple[str, str, str], list[float]] = {}
    for record in records:
        key = (record["implementation"], record["family"], record["split"])
        groups.setdefault(key, []).append(abs(record["error"]))
    lines = [f"{'implementation':<16} {'family':<20} {'split':<9} {'points':>6} {'median':>7} {'worst':>7}"]
    for (impl, family, split), values in sorted(groups.items(), key=lambda g: (*g[0][:2], order[g[0][2]])):
        lines.append(
            f"{impl:<16} {family:<20} {split:<9} {len(values):>6} "
            f"{statistics.median(values):>7.1%} {max(values):>7.1%}"
        )
    if points:
        lines += ["", "held-out and unfitted points (measured ms, predicted ms, error):"]
        for record in records:
            if record["held_out"]:
                lines.append(
                    f"  {record['point']}  {record['measured_ms']:.4g}  {record['predicted_ms']:.4g}  "
                    f"{record['error']:+.1%}"
                )
    return lines


def _check(args: argparse.Namespace) -> int:
    results = measurements.load_results(args.check, gpu=args.gpu)
    if not results.points:
        raise ValueError(f"results directory {args.check!r}: no GPU measurements found")
    records = calibrate.fit_report(results.points, args.calibration)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    print("\n".join(check_lines(records, args.points)))
    return 0


def check_mode_options(args: argparse.Namespace) -> None:
    """Refuse the options of a mode that is not running: they were silently ignored (``--output`` without
    ``--calibrate`` wrote nothing and said nothing), ``--check`` next to ``--calibrate`` never ran, and an op
    next to either was dropped while the refit walked DIR."""
    if args.calibrate and args.check:
        raise CommandError("--calibrate and --check: give one of them (run predict twice for both)")
    for flag, given, mode in (
        ("--output", args.output is not None, args.calibrate),
        ("--iterations", args.iterations is not None, args.calibrate),
        ("--points", args.points, args.check),
    ):
        if given and not mode:
            needed = "--calibrate DIR" if flag != "--points" else "--check DIR"
            raise CommandError(f"{flag} only applies with {needed}")
    mode, folder = ("--calibrate", args.calibrate) if args.calibrate else ("--check", args.check)
    if folder and (args.op is not None or args.problem):
        # The refit reads every result under DIR; an op beside it was silently dropped.
        given = " ".join([args.op or "", *args.problem]).strip()
        raise CommandError(
            f"{mode} DIR and an op (got {given!r}): {mode} takes no op or KEY=VALUE problem; run "
            f"`predict OP KEY=VALUE ...` on its own"
        )
    if folder and not Path(folder).expanduser().is_dir():
        raise CommandError(f"{mode}: {folder!r} {missing_path(folder, 'folder')} (expected a results folder)")


def _run(args: argparse.Namespace) -> int:
    check_mode_options(args)
    if args.list:
        return _list(args)
    if args.calibrate:
        return _calibrate(args)
    if args.check:
        return _check(args)
    return _predict(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``predict``."""
    parser = subparsers.add_parser(
        "predict",
        help="calibrated time of an op on a GPU, its bound and why; refit from measured results",
        description="Predict what an op of the op table takes on a GPU (llm_speed.perf.predict), or refit "
        "the predictions' parameters from a results directory (--calibrate).",
    )
    parser.add_argument("op", nargs="?", help="op table row (gemm, flash_attention, ...; see --list)")
    parser.add_argument(
        "problem",
        nargs="*",
        metavar="KEY=VALUE",
        help="the problem: m=4096 n=4096 k=4096, batch=1 heads_q=16 seq_q=4096 head_dim=128 ...",
    )
    parser.add_argument("--gpu", default=None, help=DEFAULT_GPU_HELP)
    parser.add_argument(
        "--implementation",
        default="llm-speed",
        help="llm-speed, vendor, cublas, sdpa-flash, sdpa-cudnn, sdpa-efficient, pytorch, ring, nvls ...",
    )
    parser.add_argument(
        "--context",
        default="bench",
        choices=CONTEXTS,
        help="bench: as llm-speed bench times it (L2 flushed); stream: back to back; isolated: one call",
    )
    parser.add_argument(
        "--build", default=None, help="llm-speed build of the calibration's builds (default: this checkout)"
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help=f"calibration JSON (default: ${CALIBRATION_ENV} or the shipped one)",
    )
    parser.add_argument(
        "--calibrate",
        default=None,
        metavar="DIR",
        help="refit the parameters from the measurements under DIR (benchmarks/results/<gpu>)",
    )
    parser.add_argument(
        "--check",
        default=None,
        metavar="DIR",
        help="errors of the current calibration on the measurements under DIR, by split",
    )
    parser.add_argument(
        "--output", default=None, metavar="FILE", help="--calibrate: write the new calibration"
    )
    parser.add_argument("--points", action="store_true", help="--check: also list every held-out point")
    parser.add_argument(
        "--iterations",
        type=positive_int,
        default=None,
        help=f"--calibrate: simplex steps per start (default {DEFAULT_ITERATIONS})",
    )
    parser.add_argument("--list", action="store_true", help="list the ops and implementations")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=_run)
