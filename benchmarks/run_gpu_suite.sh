#!/usr/bin/env bash
# One command for a short GPU lease: doctor, the GPU test suite, the standard benchmark set and the demo,
# every result (JSON, logs, PNG, junit XML) written to OUTDIR, the whole run kept under a 10-minute limit.
#
#   benchmarks/run_gpu_suite.sh OUTDIR            # run everything (needs a CUDA GPU)
#   benchmarks/run_gpu_suite.sh --dry-run OUTDIR  # print the steps and their time caps, run nothing
#
# Environment: PYTHON (default python3) is the interpreter with torch/triton installed; llm_speed is imported
# from this checkout's src/. SUITE_BUDGET_S (default 540) caps the total; PYTEST_WORKERS (default 4) is the
# pytest-xdist worker count (1 runs pytest without xdist). Each step has its own time cap and never gets more
# than the budget left; a step that fails or times out is recorded and the next one still runs.
# OUTDIR/summary.tsv lists every step with its exit code (124 = timed out) and seconds.
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
OUT=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${SUITE_BUDGET_S:-540}
WORKERS=${PYTEST_WORKERS:-4}
MIN_STEP_S=15  # a step with less time than this left is skipped rather than started
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
# Benchmarks and tests must run compiled Triton kernels, never the interpreter.
export TRITON_INTERPRET=0
cd "$ROOT" || exit 2

if [ "$DRY_RUN" = 0 ]; then
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "run_gpu_suite.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is False)" >&2
        exit 2
    fi
    mkdir -p "$OUT"
    printf "step\texit_code\tseconds\tcap_s\n" > "$OUT/summary.tsv"
fi

START=$SECONDS
FAILED=0

# step NAME CAP_SECONDS COMMAND...: run COMMAND with its output in OUT/NAME.log, at most CAP_SECONDS.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$cap" -gt "$left" ]; then cap=$left; fi
    if [ "$DRY_RUN" = 1 ]; then
        echo "[$name] cap ${cap}s: $*"
        return
    fi
    if [ "$cap" -lt "$MIN_STEP_S" ]; then
        echo "[$name] skipped: only ${left}s of the ${BUDGET}s budget left" | tee -a "$OUT/skipped.txt"
        printf "%s\tskipped\t0\t%s\n" "$name" "$cap" >> "$OUT/summary.tsv"
        FAILED=1
        return
    fi
    echo "[$name] (cap ${cap}s) $*"
    local began=$SECONDS
    timeout --kill-after=10 "$cap" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - began))" "$cap" >> "$OUT/summary.tsv"
    echo "[$name] exit $rc after $((SECONDS - began))s"
    if [ "$rc" -ne 0 ]; then FAILED=1; fi
}

CLI=("$PY" -m llm_speed.cli)
QUICK=(--warmup 5 --iterations 20 --no-progress)

if [ "$DRY_RUN" = 0 ]; then
    {
        echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "git_commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
        nvidia-smi 2>/dev/null || echo "nvidia-smi: not available"
    } > "$OUT/environment.txt"
fi

# doctor compiles the kernels once on tiny inputs; Triton's disk cache can serve later steps that reuse them.
step doctor 90 "${CLI[@]}" doctor --output "$OUT/doctor.json"

if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$WORKERS")
else
    XDIST=(-p no:xdist)
fi
step pytest 210 "$PY" -m pytest tests -q -ra "${XDIST[@]}" --durations=25 --junitxml="$OUT/pytest.xml"

step attention_fwd 45 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype fp16 \
    --output "$OUT/attention_fwd.json" --plot "$OUT/attention_fwd.png"
step attention_gqa_causal_bf16 45 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype bf16 --causal \
    --batch-size 1 --num-heads 32 --num-kv-heads 8 --head-dim 128 --seq-lengths 1024 2048 4096 8192 \
    --output "$OUT/attention_gqa_causal_bf16.json" --plot "$OUT/attention_gqa_causal_bf16.png"
step attention_fwd_bwd 60 "${CLI[@]}" bench attention "${QUICK[@]}" --dtype fp16 --mode fwd+bwd \
    --seq-lengths 1024 2048 4096 --output "$OUT/attention_fwd_bwd.json" --plot "$OUT/attention_fwd_bwd.png"
step gemm_fp16 30 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype fp16 \
    --output "$OUT/gemm_fp16.json" --plot "$OUT/gemm_fp16.png"
step gemm_llama3_8b_bf16 45 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype bf16 --layout NT \
    --model llama-3-8b --tokens 4096 --output "$OUT/gemm_llama3_8b_bf16.json" --plot "$OUT/gemm_llama3_8b_bf16.png"
step gemm_int8 25 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype int8 \
    --sizes 1024x1024x1024 2048x2048x2048 4096x4096x4096 --output "$OUT/gemm_int8.json"
step gemm_epilogue 25 "${CLI[@]}" bench gemm "${QUICK[@]}" --dtype fp16 --epilogue bias+gelu \
    --sizes 2048x2048x2048 4096x4096x4096 --output "$OUT/gemm_epilogue.json"
step demo 45 "${CLI[@]}" demo --output-dir "$OUT/demo"

if [ "$DRY_RUN" = 1 ]; then exit 0; fi
echo "total $((SECONDS - START))s; results in $OUT (summary.tsv lists every step)"
exit "$FAILED"
