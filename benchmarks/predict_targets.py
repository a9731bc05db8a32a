"""Print the performance model's predictions for the benchmark points of issues 6 and 7 as markdown tables.

Every figure is either computed by ``llm_speed.perf`` (attention_cost, gemm_cost, roofline, wave_quantization,
gemm_shapes) for an H100 SXM, or is a published TFLOP/s figure quoted by the issues, turned into a time.
Nothing here is measured. docs/guides/attention-hopper.md and docs/guides/gemm.md hold this script's exact
output (the attention and the GEMM tables).

    python benchmarks/predict_targets.py              # every table
    python benchmarks/predict_targets.py attention    # issue 6 only (or: gemm, issue 7 only)

For the GPU run it also writes the ``llm-speed`` argument lines that measure exactly these points (one per
line, to feed ``llm_speed.cli.main`` in one process), and summarizes the JSON files they leave:

    python benchmarks/predict_targets.py commands attention --dtypes fp16 bf16 --out /tmp/r
    python benchmarks/predict_targets.py summarize /tmp/r
    python benchmarks/predict_targets.py overhead /tmp/r/overhead.json   # llm-speed bench overhead's table

``summarize`` puts the calibrated prediction (``llm_speed.perf.predict``) and its error beside each measured
time, and says whether the point was held out of the calibration's fit (``llm_speed.perf.calibrate``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llm_speed.core.gpus import get_gpu
from llm_speed.perf.gemm_tiling import wave_quantization
from llm_speed.perf.kernel_costs import BACKWARD_TO_FORWARD_FLOPS, attention_cost, gemm_cost
from llm_speed.perf.models import gemm_shapes
from llm_speed.perf.roofline import roofline

GPU = get_gpu("h100-sxm")
DTYPE = "bf16"  # fp16 has the same element size and the same dense peak on Hopper

# Issue 6's grid: batch * seq = 16k tokens, heads * head_dim = 2048, GQA with 8 query heads per kv head.
ATTENTION_TOKENS = 16 * 1024
ATTENTION_WIDTH = 2048
GQA_GROUP = 8
HEAD_DIMS = (64, 128)
SEQ_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)

# Issue 6's published table (H100 SXM, fp16, seq 16k), TFLOP/s: (head_dim, causal, mode) -> per impl.
# The issue does not name the backward's mask; it is placed at non-causal here.
PUBLISHED_ATTENTION = {
    (64, False, "fwd"): {"FA2": 324, "Triton tut.": 403, "cuDNN": 413, "FA3": 497},
    (128, False, "fwd"): {"FA2": 370, "Triton tut.": 395, "cuDNN": 595, "FA3": 648},
    (128, True, "fwd"): {"FA2": 335, "Triton tut.": 378, "cuDNN": 539, "FA3": 616},
    (128, False, "bwd"): {"FA2": 322, "cuDNN": 516, "FA3": 561},
}
# Issue 6's stretch targets in model TFLOP/s (head_dim 128, seq 16k, non-causal).
ATTENTION_AIMS = {(128, False, "fwd"): 600, (128, False, "bwd"): 450}
# Matmuls our backward executes: dK/dV kernel QK^T, P^T dO, dO V^T, dS^T Q; dQ kernel QK^T, dO V^T, dS K.
OUR_BACKWARD_MATMULS = 7
MODEL_BACKWARD_MATMULS = 2 * BACKWARD_TO_FORWARD_FLOPS  # the 5 of the FLOP convention

# Issue 7's grid.
SQUARE_SIZES = (512, 1024, 2048, 4096, 8192)
GEMM_MODELS = ("llama-3-8b", "llama-3-70b")
GEMM_TOKENS = (1, 16, 128, 2048, 8192)
TILES = ((128, 128), (128, 256))
# SDPA backends the attention points are compared with (the naive and math paths would dominate the run).
ATTENTION_IMPLS = ("flash", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
TIMING_ARGS = "--no-progress --warmup 5 --iterations 20"
# Issue 7's published figure: 8192^3 bf16 torch.matmul at about 800 TFLOP/s on an H100.
PUBLISHED_GEMM_TFLOPS = {8192: 800}


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header, rows) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _at_rate(flops: float, tflops: float) -> str:
    """Time in us of ``flops`` at ``tflops`` TFLOP/s, and that rate as a fraction of the dense peak."""
    return f"{_us(flops / (tflops * 1e12))} ({tflops * 1e12 / GPU.peak_flops(DTYPE):.0%})"


def _bound(point) -> str:
    return "C" if point.bound == "compute" else "M"


def attention_point(head_dim: int, seq: int, causal: bool, mode: str, gqa: bool):
    """Roofline point of one issue-6 benchmark point (flash, minimum bytes)."""
    heads = ATTENTION_WIDTH // head_dim
    cost = attention_cost(
        ATTENTION_TOKENS // seq, heads, seq, seq, head_dim,
        heads_kv=heads // GQA_GROUP if gqa else heads, dtype=DTYPE, causal=causal, mode=mode,
    )  # fmt: skip
    return roofline(cost.flops, cost.bytes_moved, DTYPE, GPU)


def attention_tables() -> list[str]:
    """Issue 6: one row per (head_dim, mask, seq); MHA / GQA side by side where they differ."""
    header = [
        "d", "mask", "seq", "batch x heads", "fwd GFLOP", "fwd MB MHA/GQA", "fwd FLOP/B MHA/GQA", "fwd bound",
        "fwd floor us MHA/GQA", "bwd GFLOP", "bwd MB MHA/GQA", "bwd bound", "bwd floor us",
    ]  # fmt: skip
    rows = []
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for seq in SEQ_LENGTHS:
                fwd = [attention_point(head_dim, seq, causal, "fwd", gqa) for gqa in (False, True)]
                bwd = [attention_point(head_dim, seq, causal, "bwd", gqa) for gqa in (False, True)]
                rows.append([
                    head_dim, "causal" if causal else "full", seq,
                    f"{ATTENTION_TOKENS // seq} x {ATTENTION_WIDTH // head_dim}",
                    f"{fwd[0].flops / 1e9:,.1f}",
                    "/".join(f"{p.bytes_moved / 1e6:.0f}" for p in fwd),
                    "/".join(f"{p.intensity:.0f}" for p in fwd),
                    "/".join(_bound(p) for p in fwd),
                    "/".join(_us(p.time_floor_s) for p in fwd),
                    f"{bwd[0].flops / 1e9:,.1f}",
                    "/".join(f"{p.bytes_moved / 1e6:.0f}" for p in bwd),
                    "/".join(_bound(p) for p in bwd),
                    "/".join(_us(p.time_floor_s) for p in bwd),
                ])  # fmt: skip
    peak = GPU.peak_flops(DTYPE)
    lines = [
        f"Model prediction, {GPU.name}, {DTYPE} (fp16 identical): peak {peak / 1e12:.1f} "
        f"TFLOP/s, {GPU.memory_bandwidth / 1e12:.2f} TB/s, ridge {peak / GPU.memory_bandwidth:.0f} "
        "FLOP/B. C = compute-bound, M = memory-bound; floor = max(FLOPs/peak, bytes/bandwidth).",
        "",
        *_table(header, rows),
        "",
        "Published figures (issue 6, fp16, seq 16k) as times at the same points; us (% of dense peak).",
        "",
    ]
    names = ("FA2", "Triton tut.", "cuDNN", "FA3")
    published_rows = []
    for (head_dim, causal, mode), figures in PUBLISHED_ATTENTION.items():
        point = attention_point(head_dim, SEQ_LENGTHS[-1], causal, mode, gqa=False)
        cells = [_at_rate(point.flops, figures[n]) if n in figures else "-" for n in names]
        aim = ATTENTION_AIMS.get((head_dim, causal, mode))
        aim_cell = f"{aim}: {_at_rate(point.flops, aim)}" if aim else "-"
        if aim and mode == "bwd":
            executed = aim * OUR_BACKWARD_MATMULS / MODEL_BACKWARD_MATMULS
            aim_cell += f"; executed {executed:.0f} ({executed * 1e12 / peak:.0%})"
        published_rows.append(
            [head_dim, "causal" if causal else "full", mode, _us(point.time_floor_s), *cells, aim_cell]
        )
    header = ["d", "mask", "mode", "floor us", *names, "issue aim TFLOP/s: us (% peak)"]
    lines += _table(header, published_rows)
    return lines


def gemm_point(m: int, n: int, k: int):
    """Roofline point of out[m, n] = A[m, k] @ B[k, n] in DTYPE: each operand read once, out written once."""
    cost = gemm_cost(m, n, k, dtype=DTYPE)
    return roofline(cost.flops, cost.bytes_moved, DTYPE, GPU)


def _waves(m: int, n: int) -> list[str]:
    cells = []
    for tile_m, tile_n in TILES:
        wq = wave_quantization(m, n, tile_m, tile_n, GPU)
        cells.append(f"{wq.tiles}/{wq.waves}/{wq.efficiency:.0%}")
    return cells


def _gemm_row(m: int, n: int, k: int) -> list:
    point = gemm_point(m, n, k)
    return [
        m, n, k, f"{point.flops / 1e9:,.2f}", f"{point.bytes_moved / 1e6:,.1f}", f"{point.intensity:,.0f}",
        _bound(point), _us(point.time_floor_s), *_waves(m, n),
    ]  # fmt: skip


def gemm_tables() -> list[str]:
    """Issue 7: square sizes, then each model's weight GEMMs at each token count."""
    wave_heads = [f"{tm}x{tn} tiles/waves/eff" for tm, tn in TILES]
    head = ["M", "N", "K", "GFLOP", "MB", "FLOP/B", "bound", "floor us", *wave_heads]
    square = []
    for size in SQUARE_SIZES:
        row = _gemm_row(size, size, size)
        published = PUBLISHED_GEMM_TFLOPS.get(size)
        row.append(f"torch {published}: {_us(2 * size**3 / (published * 1e12))} us" if published else "-")
        square.append(row)
    lines = [
        f"Model prediction, {GPU.name}, {DTYPE}, {GPU.sm_count} SMs, one tile per SM per wave; "
        "bytes = A + B read once + out written once; eff = tiles / (waves x SMs).",
        "",
        *_table([*head, "published"], square),
        "",
    ]
    for model in GEMM_MODELS:
        rows = []
        for tokens in GEMM_TOKENS:
            for shape in gemm_shapes(model, tokens):
                rows.append([shape.name, *_gemm_row(shape.m, shape.n, shape.k)])
        lines += [f"{model} weight GEMMs (x @ W, M = tokens):", "", *_table(["layer", *head], rows), ""]
    return lines[:-1]


def attention_commands(dtypes, modes, out: str) -> list[str]:
    """``llm-speed`` argument lines for issue 6's grid, one line per point (batch = 16k / seq)."""
    lines = []
    for dtype in dtypes:
        for mode in modes:
            for head_dim in HEAD_DIMS:
                heads = ATTENTION_WIDTH // head_dim
                for causal in (False, True):
                    for gqa in (False, True):
                        for seq in SEQ_LENGTHS:
                            name = (
                                f"attn_{dtype}_{mode}_d{head_dim}_{'causal' if causal else 'full'}_"
                                f"{'gqa' if gqa else 'mha'}_s{seq}"
                            )
                            lines.append(
                                f"bench attention {TIMING_ARGS} --dtype {dtype} --mode {mode} "
                                f"--head-dim {head_dim} --num-heads {heads} "
                                f"--num-kv-heads {heads // GQA_GROUP if gqa else heads} "
                                f"--batch-size {ATTENTION_TOKENS // seq} --seq-lengths {seq} "
                                f"--impl {' '.join(ATTENTION_IMPLS)}{' --causal' if causal else ''} "
                                f"--output {out}/{name}.json"
                            )
    return lines


def gemm_commands(dtypes, out: str) -> list[str]:
    """``llm-speed`` argument lines for issue 7's grid: squares (NN), then each model and token count (NT)."""
    lines = []
    for dtype in dtypes:
        sizes = " ".join(f"{n}x{n}x{n}" for n in SQUARE_SIZES)
        lines.append(
            f"bench gemm {TIMING_ARGS} --dtype {dtype} --sizes {sizes} "
            f"--output {out}/gemm_{dtype}_square.json"
        )
        for model in GEMM_MODELS:
            for tokens in GEMM_TOKENS:
                lines.append(
                    f"bench gemm {TIMING_ARGS} --dtype {dtype} --layout NT --model {model} --tokens {tokens} "
                    f"--output {out}/gemm_{dtype}_{model}_t{tokens}.json"
                )
    return lines


def _split(points, folder: str) -> list[str]:
    """Each point's split in the shipped calibration's fit: "fit", "held out", or "not fitted" (a kind no fit
    uses: 8-bit, eager, forward+backward), over the directory it was fitted on (its ``last_fit``) when
    ``folder`` is in it (the held-out rule ranks sizes across every file there), else over ``folder``."""
    from llm_speed.perf.calibrate import held_out
    from llm_speed.perf.measurements import load_results
    from llm_speed.perf.predict import load_calibration

    fitted_on = load_calibration().get("last_fit", {}).get("directory")
    root = Path(fitted_on) if fitted_on else None
    if root is not None and not root.is_absolute():
        root = Path(__file__).resolve().parents[1] / root
    every = points
    if root is not None and root.is_dir() and Path(folder).resolve().is_relative_to(root.resolve()):
        every = load_results(root).points
    key = lambda p: (p.source, p.implementation, p.then, p.row)  # noqa: E731
    flags = dict(zip(map(key, every), held_out(every), strict=True))
    return [
        "not fitted" if not p.fitted else ("held out" if flags[key(p)] else "fit") for p in points
    ]


def _predictions(folder: str) -> dict[tuple[str, str, str], tuple[float, float, str]]:
    """(file stem, case, impl) -> (measured s, predicted s, split) for every point llm_speed.perf can read in
    ``folder`` (its calibration's predictions: llm_speed.perf.predict)."""
    from llm_speed.perf.calibrate import prediction_of
    from llm_speed.perf.measurements import load_results

    points = load_results(folder).points
    found = {}
    for point, split in zip(points, _split(points, folder), strict=True):
        stem = Path(point.source.partition(":")[0]).stem
        prediction = prediction_of(point, None).seconds
        found[(stem, point.case, point.row)] = (point.measured_s, prediction, split)
    return found


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _error(entry) -> str:
    return "-" if entry is None or entry[1] is None else f"{entry[1] / entry[0] - 1:+.0%}"


# The bench rows of llm-speed's own kernels that summarize lists (its fp8 attention beside the 16-bit one).
OURS = ("flash", "llm-speed", "flash-fp8")


def summarize(folder: str) -> list[str]:
    """One row per measured point of every benchmark JSON in ``folder``: ours against the fastest other, each
    with the calibrated prediction (llm_speed.perf.predict) and its error, and whether the point was held out
    of the calibration's fit."""
    predicted = _predictions(folder)
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        document = json.loads(path.read_text())
        if "results" not in document or document.get("benchmark", "attention") not in ("attention", "gemm"):
            continue  # the suite's summaries, the per-call overhead (its own table)
        timed = {(r["case"], r["impl"]): r["timing"]["median_ms"] / 1e3 for r in document["results"]
                 if r.get("available") and r.get("timing")}  # fmt: skip
        for row in document["results"]:
            if row["impl"] not in OURS or row.get("available") is False:
                continue
            ratio, over = row["speedup_vs_fastest_other"], row["measured_over_predicted"]
            ours = predicted.get((path.stem, row["case"], row["impl"]))
            other = None
            if row["fastest_other"]:
                # measured from the file; predicted where the model reads the row (not SDPA's default backend)
                key = (row["case"], row["fastest_other"])
                fitted = predicted.get((path.stem, *key))
                other = fitted or ((timed[key], None, "-") if key in timed else None)
            split = "-" if ours is None else ours[2]
            case = row["case"] if row["impl"] in ("flash", "llm-speed") else f"{row['case']} ({row['impl']})"
            rows.append([
                path.stem, case, split, f"{row['tflops']:.1f}" if row["tflops"] else row["reason"],
                _ms(ours[0] if ours else None), _ms(ours[1] if ours else None), _error(ours),
                row["fastest_other"] or "-", _ms(other[0] if other else None),
                _ms(other[1] if other else None),
                _error(other), f"{ratio:.2f}" if ratio else "-", f"{over:.2f}" if over else "-",
            ])  # fmt: skip
    header = [
        "file", "case", "split", "ours TFLOP/s", "ours ms", "predicted ms", "error", "fastest other",
        "other ms", "its predicted ms", "its error", "ours / fastest", "measured / floor",
    ]  # fmt: skip
    return _table(header, rows)


def overhead_table(path: str) -> list[str]:
    """``llm-speed bench overhead`` on a GPU (its JSON): per op and mode, llm-speed's wall time and kernel
    time per call beside PyTorch's equivalent's, and their ratio (the GPU target: at most 1.3x)."""
    document = json.loads(Path(path).read_text())
    by_case = {(r["case"], r["mode"]): r for r in document["results"]}
    rows = []
    for row in document["results"]:
        if row["baseline"] is None:
            continue
        theirs = by_case.get((row["baseline"], row["mode"]))
        met = "-" if row["meets_target"] is None else ("yes" if row["meets_target"] else "no")
        rows.append([
            row["case"], row["mode"], f"{row['us_per_call']:.1f}", f"{row['kernel_us']:.1f}", row["baseline"],
            f"{theirs['us_per_call']:.1f}" if theirs else "-",
            f"{theirs['kernel_us']:.1f}" if theirs else "-",
            f"{row['vs_baseline']:.2f}" if row["vs_baseline"] else "-", met,
        ])  # fmt: skip
    header = ["op", "mode", "us per call", "kernel us", "PyTorch's", "its us per call", "its kernel us",
              "ours / PyTorch's", "<= 1.3x"]  # fmt: skip
    return _table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """Print the tables of the chosen part(s), the benchmark argument lines, or a summary of results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = ("all", "attention", "gemm", "commands", "summarize", "overhead")
    parser.add_argument("part", nargs="?", default="all", choices=parts)
    parser.add_argument("target", nargs="?", help="commands: attention or gemm; summarize: the JSON folder; "
                        "overhead: a GPU run's overhead.json")  # fmt: skip
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--out", default="results", help="commands: where the JSON files go")
    args = parser.parse_args(argv)
    if args.part == "commands":
        if args.target not in ("attention", "gemm"):
            parser.error("commands needs a target: attention or gemm")
        lines = (
            attention_commands(args.dtypes, args.modes, args.out)
            if args.target == "attention"
            else gemm_commands(args.dtypes, args.out)
        )
    elif args.part == "summarize":
        if args.target is None:
            parser.error("summarize needs the folder of benchmark JSON files")
        lines = summarize(args.target)
    elif args.part == "overhead":
        if args.target is None:
            parser.error("overhead needs the JSON of a GPU run of llm-speed bench overhead")
        lines = overhead_table(args.target)
    else:
        lines = []
        if args.part in ("all", "attention"):
            lines += attention_tables()
        if args.part == "all":
            lines.append("")
        if args.part in ("all", "gemm"):
            lines += gemm_tables()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
