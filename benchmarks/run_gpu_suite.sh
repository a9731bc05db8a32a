#!/usr/bin/env bash
# One command for a short GPU lease: doctor, the GPU test suite, the standard benchmark set and the demo.
# Everything ends up in OUTDIR as three files (few files travel back from a leased machine more easily):
#   OUTDIR/summary.json    device, versions, git commit, every step with its exit code and seconds
#   OUTDIR/summary.txt     the same for a person, plus the tail of the pytest log
#   OUTDIR/results.tar.gz  every log, benchmark JSON, plot, the pytest junit XML and the demo's files
# Both summaries and the archive are rewritten after every step, so a run cut short still leaves results.
#
#   benchmarks/run_gpu_suite.sh OUTDIR            # run everything (needs a CUDA GPU)
#   benchmarks/run_gpu_suite.sh --dry-run OUTDIR  # print the steps and their time caps, run nothing
#
# Environment:
#   PYTHON (default python3)    the interpreter with torch/triton; llm_speed is imported from this checkout's src/
#   SUITE_BUDGET_S (default 500) total seconds for the steps; each step has its own cap and never gets more
#                               than the budget left, so the whole run fits a 10-minute command limit
#   SUITE_STEPS                 space-separated step names to run (default: all; see --dry-run)
#   PYTEST_WORKERS (default 8)  pytest-xdist workers for the test step (1: no xdist)
#   LLM_SPEED_GIT_COMMIT        the commit to record when the checkout has no .git (a copied working tree)
#   SUITE_ALLOW_CPU=1           run without a GPU (only to test this script; the results mean nothing)
# Exit code: 0 when every step passed, 1 when one failed, timed out (exit code 124) or was skipped, 2 on bad use.
set -u

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
if [ $# -ne 1 ]; then
    echo "usage: $0 [--dry-run] OUTDIR" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$1
if [ "$DRY_RUN" = 0 ]; then
    if ! mkdir -p "$OUT" || [ ! -w "$OUT" ]; then
        echo "run_gpu_suite.sh: cannot write to OUTDIR $OUT" >&2
        exit 2
    fi
    OUT=$(cd "$OUT" && pwd)  # absolute, before the cd below
fi
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-500}
WORKERS=${PYTEST_WORKERS:-8}
ONLY=${SUITE_STEPS:-}
MIN_STEP_S=15    # a step with less time than this left is skipped rather than started
KILL_GRACE_S=10  # after its cap a step gets SIGTERM, and SIGKILL this much later
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Benchmarks and tests must run compiled Triton kernels, never the interpreter.
export TRITON_INTERPRET=0
cd "$ROOT" || exit 2

if [ "$DRY_RUN" = 0 ]; then
    if [ "${SUITE_ALLOW_CPU:-0}" != 1 ] \
        && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "run_gpu_suite.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False)" >&2
        exit 2
    fi
    # Raw files live outside OUTDIR and travel packed; OUTDIR only ever holds the three files above.
    RAW=$(mktemp -d "${TMPDIR:-/tmp}/llm-speed-suite.XXXXXX") || exit 2
    printf "step\texit_code\tseconds\tcap_s\n" > "$RAW/summary.tsv"
    COMMIT=${LLM_SPEED_GIT_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)}
    if [ -n "$COMMIT" ]; then
        export LLM_SPEED_GIT_COMMIT=$COMMIT  # the benchmark JSONs record the same commit
    else
        COMMIT="unknown (no .git here: pass LLM_SPEED_GIT_COMMIT)"
    fi
    {
        echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "git_commit: $COMMIT"
        nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    } > "$RAW/environment.txt"
fi

START=$SECONDS
FAILED=0

# Rewrite OUTDIR's summaries and archive from RAW (atomically: a reader never sees half a file).
pack() {
    "$PY" "$ROOT/benchmarks/suite_summary.py" "$RAW" "$OUT" > /dev/null 2>> "$RAW/pack_errors.log" \
        || echo "run_gpu_suite.sh: writing the summaries failed (see pack_errors.log in the archive)" >&2
    if [ ! -s "$RAW/pack_errors.log" ]; then rm -f "$RAW/pack_errors.log"; fi
    tar -czf "$OUT/.results.tar.gz.tmp" -C "$RAW" . && mv -f "$OUT/.results.tar.gz.tmp" "$OUT/results.tar.gz"
}

# step NAME CAP_SECONDS COMMAND...: run COMMAND with its output in NAME.log, at most CAP_SECONDS.
step() {
    local name=$1 cap=$2
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$cap" -gt "$left" ]; then cap=$left; fi
    if [ "$DRY_RUN" = 1 ]; then
        echo "[$name] cap ${cap}s: $*"
        return
    fi
    if [ "$cap" -lt "$MIN_STEP_S" ]; then
        echo "[$name] skipped: only ${left}s of the ${BUDGET}s budget left"
        printf "%s\tskipped\t0\t%s\n" "$name" "$cap" >> "$RAW/summary.tsv"
        FAILED=1
        return
    fi
    echo "[$name] (cap ${cap}s) $*"
    local began=$SECONDS
    # timeout signals the whole process group, so pytest-xdist workers stop with their parent.
    timeout --kill-after="$KILL_GRACE_S" "$cap" "$@" > "$RAW/$name.log" 2>&1
    local rc=$?
    printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - began))" "$cap" >> "$RAW/summary.tsv"
    echo "[$name] exit $rc after $((SECONDS - began))s"
    if [ "$rc" -ne 0 ]; then FAILED=1; fi
    pack
}

CLI=("$PY" -m llm_speed.cli)
QUICK=(--warmup 5 --iterations 20 --no-progress)
R=${RAW:-OUTDIR}  # where the steps write (shown as OUTDIR in a dry run)

if [ "$DRY_RUN" = 0 ]; then
    "$PY" - > "$RAW/versions.json" 2>&1 <<'EOF'
import json, platform, torch, triton
info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, compute_capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
print(json.dumps(info, indent=1))
EOF
    pack
fi

# doctor compiles the kernels once on tiny inputs; Triton's disk cache serves later steps that reuse them.
step doctor 60 "${CLI[@]}" doctor --output "$R/doctor.json"

# Per-test limit where pytest-timeout is installed, so one hanging test cannot take the whole step.
PYTEST_EXTRA=()
if [ "$DRY_RUN" = 0 ] && "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST_EXTRA+=(--timeout=120); fi
if [ "$WORKERS" -gt 1 ] && { [ "$DRY_RUN" = 1 ] || "$PY" -c "import xdist" 2>/dev/null; }; then
    PYTEST_EXTRA+=(-n "$WORKERS")
else
    PYTEST_EXTRA+=(-p no:xdist)
fi
step pytest 200 "$PY" -m pytest tests -q -ra -p no:cacheprovider "${PYTEST_EXTRA[@]}" --durations=25 \
    --junitxml="$R/pytest.xml"

# Benchmarks: each writes its JSON only when done, so the caps leave room for Triton's compilation and the
# GEMM autotuner (one tuning run per shape bucket) before the timed runs.
step attention_fwd 45 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype fp16 --seq-lengths 1024 2048 4096 8192 \
    --output "$R/attention_fwd.json" --plot "$R/attention_fwd.png"
step gemm_llama3_8b_bf16 60 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype bf16 --layout NT \
    --model llama-3-8b --tokens 4096 --output "$R/gemm_llama3_8b_bf16.json" --plot "$R/gemm_llama3_8b_bf16.png"
step attention_gqa_causal_bf16 40 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype bf16 --causal \
    --batch-size 1 --num-heads 32 --num-kv-heads 8 --head-dim 128 --seq-lengths 2048 4096 8192 \
    --output "$R/attention_gqa_causal_bf16.json" --plot "$R/attention_gqa_causal_bf16.png"
step gemm_fp16 45 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype fp16 \
    --sizes 1024x1024x1024 2048x2048x2048 4096x4096x4096 8192x8192x8192 \
    --output "$R/gemm_fp16.json" --plot "$R/gemm_fp16.png"
step attention_fwd_bwd 45 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype fp16 --mode fwd+bwd \
    --seq-lengths 1024 4096 --output "$R/attention_fwd_bwd.json" --plot "$R/attention_fwd_bwd.png"
step gemm_int8 30 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype int8 \
    --sizes 2048x2048x2048 4096x4096x4096 --output "$R/gemm_int8.json"
step gemm_epilogue 30 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype fp16 --epilogue bias+gelu \
    --sizes 4096x4096x4096 --output "$R/gemm_epilogue.json"
step demo 60 "${CLI[@]}" demo --output-dir "$R/demo"

if [ "$DRY_RUN" = 1 ]; then exit 0; fi
pack
rm -rf "$RAW"
echo "total $((SECONDS - START))s; results in $OUT: summary.txt, summary.json, results.tar.gz"
cat "$OUT/summary.txt" 2>/dev/null
exit "$FAILED"
