#!/usr/bin/env bash
# The GPU run, as device commands that each fit one 10-minute command with margin (docs/guides/gpu-plan.md
# lists them in order with their timeout_s). Each STEP is one command:
#   quick   versions, `llm-speed doctor` (non-zero when an op fails) and ~30 GPU tests over every kernel
#           family, 8 workers: the proof that the kernels run (150 s; on the first H100 run, cold, 27 tests
#           had not finished in 85 s)
#   tests   the whole test suite on the GPU in three chunks (attention, matmul, the rest), each with its
#           own junit XML, so a chunk cut by its cap costs only that chunk
#   bench   the benchmark sets (one shape per llm-speed call, each writing its JSON when measured: attention,
#           GEMM, the KV-cache decode step, fp8 GEMMs against torch._scaled_mm), the per-call cost of every
#           op (`bench overhead`: inference, autograd, training) and demo
#   fused   `bench ops` (Llama-3-8B layer and head at 8192 tokens, bf16: llm-speed, eager, torch.compile,
#           Liger-Kernel), `bench train-step` (llama-3-8b, 2 layers: transformers, llm-speed, Liger) and
#           `bench moe` (fused MoE forward + backward against torch._grouped_mm code and the HF loop)
#   probe   the launch policy's A/B (benchmarks/attention_ab.py: every candidate of llm_speed.core.policy
#           against the shipped policy at its own target, its rounds in a row) and host time against kernel
#           time inside the bench loop (benchmarks/host_in_bench.py: GEMMs, decode steps)
# OUTDIR then holds three files, flat (a device command sends back at most 8):
#   summary.json / summary.txt  device, versions, commit, every sub-step with exit code and seconds, the
#                               pytest counts and failed test names, the benchmark rows
#   results.tar.gz              every log (pytest -v -rfE), junit XML, benchmark JSON and plot
# The summaries and archive are rewritten after every sub-step; sub-step caps fit the step's budget, so a
# cut sub-step is stopped by its cap (SIGINT: pytest still writes its junit) and the rest still runs.
#
#   benchmarks/run_gpu_suite.sh STEP OUTDIR             run (needs a CUDA GPU)
#   benchmarks/run_gpu_suite.sh --check STEP OUTDIR     CPU dry run: doctor and versions for real, every
#                                                       pytest command collected (--collect-only), every
#                                                       benchmark line parsed by the real CLI parser
#   benchmarks/run_gpu_suite.sh --dry-run STEP          print the sub-steps and their caps, run nothing
#
# Environment: PYTHON (default python3); LLM_SPEED_GIT_COMMIT (the commit to record: the device machine's
# copy has no .git); PYTEST_WORKERS (default: quick 8, tests 12); SUITE_ALLOW_CPU=1 runs for real without a
# GPU (tests of this script only).
# Wheels: every .whl in ROOT/.whl (git-excluded; liger_kernel's, say: docs/guides/gpu-plan.md gives
# the download command) is installed offline into /tmp/site, which joins PYTHONPATH after ROOT/src.
# Exit code: 0 when every sub-step passed, 1 when one failed, timed out or was skipped, 2 on bad use or no GPU
# (the summary says why), 143/130/129 when stopped by SIGTERM/SIGINT/SIGHUP (the step in flight is cut, its
# output and the summary packed first). The budget's clock starts with the script: the set-up before the first
# sub-step counts against `setup`, and each cap keeps back the kill grace and a pack, so a step that ignores
# its SIGINT still ends within the budget.
set -u

MODE=run
case "${1:-}" in
--check) MODE=check; shift ;;
--dry-run) MODE=dry; shift ;;
esac
STEP=${1:-}
# The proof's budget table (issue 70), seconds per part; BUDGET is their sum, held to 480 by a CPU test
# (tests/bench/test_gpu_suite_script.py) so that one 540-s device command holds it with a minute to spare.
PROOF_BUDGETS=(
    "setup 15"              # versions, the carried wheels, packing the summaries between parts
    "correctness 150"       # every family against float64, then each candidate launch choice
    "headline_attention 85" # d=64 guide points fwd and fwd+bwd, d=128 16k, against every SDPA backend;
                            # then fp8 against bf16 at d=128 16k, head dims 80/96/111/112, ours only
    "headline_gemm 25"      # bf16 squares 512^3..8192^3, Llama-3-8B weights at M = 1, 16, 4096 (the
                            # suite's 8-call gemm set took 14 s on the 2026-11-25 H100, cold)
    "headline_fp8 15"       # fp8 4096^3 per tensor / row / block against torch._scaled_mm
    "headline_decode 25"    # bf16 batch 1/8/64 x 4k, dense and 16-token pages, eager and graph, SDPA;
                            # the fp8 cache against the 16-bit one at batch 64
    "headline_fused 40"     # rms_norm, SwiGLU, rotary at 65536 tokens: wall, kernel time and GB/s
    "headline_ce 15"        # linear cross-entropy V=128256 N=8192 H=4096: time, peak memory
    "headline_train_step 35" # bench train-step llama-3-8b, 2 layers
    "ab 75"                 # each candidate against the shipped policy at its target, the time left
)
proof_budget() {  # proof_budget PART -> its seconds
    local row
    for row in "${PROOF_BUDGETS[@]}"; do
        if [ "${row%% *}" = "$1" ]; then echo "${row#* }"; return; fi
    done
    echo "run_gpu_suite.sh: no budget for $1" >&2
    exit 2
}
PROOF_TOTAL=0
for row in "${PROOF_BUDGETS[@]}"; do PROOF_TOTAL=$((PROOF_TOTAL + ${row#* })); done

case "$STEP" in
proof) BUDGET=$PROOF_TOTAL; DEFAULT_WORKERS=1 ;;  # correctness: a process per core
quick) BUDGET=150; DEFAULT_WORKERS=8 ;;
tests) BUDGET=510; DEFAULT_WORKERS=12 ;;
bench) BUDGET=440; DEFAULT_WORKERS=1 ;;
fused) BUDGET=460; DEFAULT_WORKERS=1 ;;
probe) BUDGET=440; DEFAULT_WORKERS=1 ;;
*) echo "usage: $0 [--check|--dry-run] proof|quick|tests|bench|fused|probe OUTDIR" >&2; exit 2 ;;
esac
if [ "$MODE" = dry ]; then OUT=OUTDIR; echo "[$STEP] budget ${BUDGET}s"; elif [ $# -ne 2 ]; then
    echo "usage: $0 [--check|--dry-run] proof|quick|tests|bench|fused|probe OUTDIR" >&2
    exit 2
else
    OUT=$2
    case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac  # relative to the caller, not to ROOT
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORKERS=${PYTEST_WORKERS:-$DEFAULT_WORKERS}
KILL_GRACE_S=15  # after its cap a sub-step gets SIGINT (pytest writes its junit), and SIGKILL this much later
MIN_STEP_S=10    # a sub-step with less time than this left is skipped rather than started
PACK_S=5         # kept back after every cap for packing the summaries
START=0          # the budget counts from the script's start (bash's SECONDS)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# One CPU thread pool per pytest worker: workers x all cores oversubscribed the 16-core machine.
CORES=$(nproc 2>/dev/null || echo 16)
export OMP_NUM_THREADS=$((CORES / WORKERS > 0 ? CORES / WORKERS : 1))
if [ "$MODE" = run ]; then
    export TRITON_INTERPRET=0  # benchmarks and GPU tests run compiled Triton kernels, never the interpreter
fi
cd "$ROOT" || exit 2

if [ "$MODE" != dry ]; then
    if ! mkdir -p "$OUT" || [ ! -w "$OUT" ]; then
        echo "run_gpu_suite.sh: cannot write to OUTDIR $OUT" >&2
        exit 2
    fi
    OUT=$(cd "$OUT" && pwd)
    # Raw files live outside OUTDIR and travel packed; OUTDIR only ever holds the three files above.
    RAW=$(mktemp -d "${TMPDIR:-/tmp}/llm-speed-suite.XXXXXX") || exit 2
    printf "step\texit_code\tseconds\tcap_s\n" > "$RAW/summary.tsv"
    COMMIT=${LLM_SPEED_GIT_COMMIT:-}
    # git's commit only where ROOT is its repository's top (a copy inside another repository would record that
    # one's HEAD), marked +dirty when the tree differs from it (the device runs the tree as it is)
    if [ -z "$COMMIT" ] && [ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" = "$ROOT" ]; then
        COMMIT=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)
        if [ -n "$COMMIT" ] && [ -n "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]; then
            COMMIT="$COMMIT+dirty"
        fi
    fi
    if [ -n "$COMMIT" ]; then
        export LLM_SPEED_GIT_COMMIT=$COMMIT  # the benchmark JSONs record the same commit
    else
        COMMIT="unknown (no .git here: pass LLM_SPEED_GIT_COMMIT)"
    fi
    {
        echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "git_commit: $COMMIT"
        echo "suite_step: $STEP ($MODE)"
        timeout -s KILL 20 nvidia-smi 2>&1 || echo "nvidia-smi: not available (or no answer in 20 s)"
    } > "$RAW/environment.txt"
else
    RAW=OUTDIR
fi
if [ "$STEP" = proof ] && [ "$MODE" != dry ]; then
    # Cold by construction: an empty Triton cache (outside RAW: it is not archived), and every compile or
    # cache load of every process logged by Triton's compilation listener (benchmarks/proof_site).
    export TRITON_CACHE_DIR="$RAW.triton-cache"
    mkdir -p "$TRITON_CACHE_DIR" || exit 2
    export LLM_SPEED_COMPILE_LOG="$RAW/triton_compiles.jsonl"
    export PYTHONPATH="$ROOT/benchmarks/proof_site:$PYTHONPATH"
    # Unless a Triton cache compiled on a CPU by the GPU machine's Python and Triton is carried
    # (ROOT/.cache/triton-carry/*.tar.gz: `make triton-cache`, benchmarks/triton_cache.py): its kernels are
    # unpacked into the run's cache, and the summary counts how many it served (their hashes in
    # carried_cache_*.json) and how many were compiled here all the same.
    # A kernel's key hashes ptxas's version: pin Triton's own ptxas (the one the carried cache was built
    # with) for every process, before torch.compile's first compile points Triton at torch's (CUDA 13.0's;
    # it leaves a path already set alone). The proof's torch.compile rows then build with it too.
    if [ -z "${TRITON_PTXAS_PATH:-}" ] && [ "$MODE" = run ]; then
        BUNDLED_PTXAS=$(timeout -s KILL 60 "$PY" -c 'import os, triton
print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))' 2>/dev/null)
        if [ -x "$BUNDLED_PTXAS" ]; then
            export TRITON_PTXAS_PATH="$BUNDLED_PTXAS"
            echo "TRITON_PTXAS_PATH=$TRITON_PTXAS_PATH (Triton's own)" >> "$RAW/environment.txt"
        fi
    fi
    for archive in "$ROOT"/.cache/triton-carry/*.tar.gz; do
        [ -e "$archive" ] || continue
        if [ "$MODE" = run ]; then
            timeout -s KILL 60 "$PY" "$ROOT/benchmarks/triton_cache.py" install "$archive" "$TRITON_CACHE_DIR" \
                --manifest-out "$RAW/carried_cache_$(basename "$archive" .tar.gz).json" 2>&1 \
                | tee -a "$RAW/environment.txt"
        else
            echo "Triton cache to unpack on a real run: $(basename "$archive")"
        fi
    done
fi

# Carried wheels (no network on the device machine): installed offline, never fetched.
WHEELS=()
for wheel in "$ROOT"/.whl/*.whl; do [ -e "$wheel" ] && WHEELS+=("$wheel"); done
if [ ${#WHEELS[@]} -gt 0 ]; then
    WHEEL_NAMES=$(for wheel in "${WHEELS[@]}"; do basename "$wheel"; done | tr '\n' ' ')
    if [ "$MODE" = run ]; then
        if timeout -s KILL 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site "${WHEELS[@]}"; then
            export PYTHONPATH="$PYTHONPATH:/tmp/site"
            echo "wheels installed into /tmp/site: $WHEEL_NAMES" | tee -a "$RAW/environment.txt"
        else
            echo "wheels NOT installed (pip failed): $WHEEL_NAMES" | tee -a "$RAW/environment.txt" >&2
        fi
    else
        echo "wheels to install into /tmp/site on a real run: $WHEEL_NAMES"
    fi
fi

FAILED=0
ARCHIVE_MAX_BYTES=$((15 * 1024 * 1024))  # a device command returns files of at most 16 MiB

# Rewrite OUTDIR's summaries and archive from RAW (atomically: a reader never sees half a file). The summary
# writer runs with -E -s (no PYTHONPATH: not the compile listener's sitecustomize, standard library only);
# should it fail, summary.txt says so on its first line rather than stand as it was. An archive over the
# return limit is rebuilt without the largest logs (the JSON, junit and summaries kept), and says so.
pack() {
    if ! timeout -s KILL 60 "$PY" -E -s "$ROOT/benchmarks/suite_summary.py" "$RAW" "$OUT" > /dev/null \
        2>> "$RAW/pack_errors.log"; then
        echo "run_gpu_suite.sh: writing the summaries failed (see pack_errors.log in the archive)" >&2
        local stale="$OUT/.summary.txt.$BASHPID.tmp"
        { echo "SUMMARY STALE: the summary writer failed after the last step below (pack_errors.log in"
          echo "results.tar.gz says why); summary.tsv in the archive has every step's exit code"
          sed '/^SUMMARY STALE/,+1d' "$OUT/summary.txt" 2>/dev/null; } > "$stale" \
            && mv -f "$stale" "$OUT/summary.txt"
    fi
    if [ ! -s "$RAW/pack_errors.log" ]; then rm -f "$RAW/pack_errors.log"; fi
    local tmp="$OUT/.results.tar.gz.$BASHPID.tmp"  # one per process: a background sub-step packs too
    timeout -s KILL 60 tar -czf "$tmp" -C "$RAW" . || { rm -f "$tmp"; return; }
    if [ "$(stat -c %s "$tmp" 2>/dev/null || echo 0)" -gt "$ARCHIVE_MAX_BYTES" ]; then
        local big
        big=$(cd "$RAW" && find . -name '*.log' -size +256k)
        echo "logs left out of this archive (it was over $ARCHIVE_MAX_BYTES bytes): $big" \
            > "$RAW/ARCHIVE_CUT.txt"
        # shellcheck disable=SC2086
        timeout -s KILL 60 tar -czf "$tmp" -C "$RAW" \
            $(for f in $big; do printf -- "--exclude=%s " "$f"; done) . || { rm -f "$tmp"; return; }
    fi
    mv -f "$tmp" "$OUT/results.tar.gz"
}

STEP_PID=""   # the running sub-step's run_capped.py, for the signal trap
STEP_NAME=""
STEP_BEGAN=0
STEP_CAP=0
# SIGTERM/SIGINT/SIGHUP (the lease's limit, a user): the step in flight is stopped as its cap would (SIGINT:
# pytest writes its junit, the benchmarks their JSON), a few seconds allowed, then its row, a row saying the
# run was cut, the summaries and archive; the correctness families' process groups are killed.
on_signal() {
    local signal=$1 code=$2
    trap - TERM INT HUP
    if [ "$MODE" != run ] && [ "$MODE" != check ]; then exit "$code"; fi
    echo "[$STEP] stopped by SIG$signal after ${SECONDS}s" >&2
    if [ -n "$STEP_PID" ]; then  # run_capped.py stops its command (SIGINT, 4 s, SIGKILL) and exits
        kill -TERM "$STEP_PID" 2>/dev/null
        local i
        for i in $(seq 1 24); do
            kill -0 "$STEP_PID" 2>/dev/null || break
            sleep 0.25
        done
        printf "%s\tcut-by-SIG%s\t%s\t%s\n" "$STEP_NAME" "$signal" "$((SECONDS - STEP_BEGAN))" "$STEP_CAP" \
            >> "$RAW/summary.tsv"
    fi
    kill_families
    printf "run\tcut-by-SIG%s\t%s\t%s\n" "$signal" "$SECONDS" "$BUDGET" >> "$RAW/summary.tsv"
    pack
    exit "$code"
}
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT
trap 'on_signal HUP 129' HUP

# The correctness families run in process groups of their own (so a cut kills each whole family); any left
# when the correctness part ends (it was killed before it could stop them) are killed here.
kill_families() {
    local pgid
    if [ -f "$RAW/correctness_pgids.txt" ]; then
        while read -r pgid; do
            [ -n "$pgid" ] && kill -KILL -- "-$pgid" 2>/dev/null
        done < "$RAW/correctness_pgids.txt"
    fi
}

# sub NAME CAP_SECONDS COMMAND...: run COMMAND with its output in NAME.log (and on stdout), at most CAP s.
# Returns 1 when the sub-step failed (for one run in the background: `sub ... &`, then `wait $! || FAILED=1`).
sub() {
    local name=$1 cap=$2
    shift 2
    # what is left once a step that ignores its SIGINT has been killed and the summaries packed
    local left=$((BUDGET - (SECONDS - START) - KILL_GRACE_S - PACK_S))
    if [ "$MODE" != dry ] && [ "$cap" -gt "$left" ]; then cap=$left; fi
    if [ "$MODE" = dry ]; then  # one write per line: a background sub-step prints beside this one
        echo "$(printf "[%s/%s] cap %ss:" "$STEP" "$name" "$cap"; printf " %q" "$@")"
        return
    fi
    if [ "$cap" -lt "$MIN_STEP_S" ]; then
        echo "[$STEP/$name] skipped: only $((left > 0 ? left : 0))s of the ${BUDGET}s budget left"
        printf "%s\tskipped\t0\t%s\n" "$name" "$((cap > 0 ? cap : 0))" >> "$RAW/summary.tsv"
        FAILED=1
        return 1
    fi
    echo "[$STEP/$name] (cap ${cap}s) $*"
    local began=$SECONDS
    # A row saying it runs, packed: if the whole command is killed now, the summary names this step.
    printf "%s\trunning\t0\t%s\n" "$name" "$cap" >> "$RAW/summary.tsv"
    pack
    # SIGINT first: pytest and gpu_bench.py stop cleanly and keep what they finished
    # (benchmarks/run_capped.py: the cap, the kill grace, the output bounded in NAME.log). In the background
    # with a wait, so that a signal to this script is handled at once (bash runs a trap only between commands).
    "$PY" -E -s "$ROOT/benchmarks/run_capped.py" --cap "$cap" --grace "$KILL_GRACE_S" --log "$RAW/$name.log" \
        -- "$@" &
    STEP_PID=$! STEP_NAME=$name STEP_BEGAN=$began STEP_CAP=$cap
    wait "$STEP_PID"
    local rc=$?
    STEP_PID=""
    printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$((SECONDS - began))" "$cap" >> "$RAW/summary.tsv"
    echo "[$STEP/$name] exit $rc after $((SECONDS - began))s"
    pack
    if [ "$rc" -ne 0 ]; then
        FAILED=1
        return 1
    fi
}

# Flags of every pytest sub-step (each adds its own --junitxml in RAW); --check only collects.
PYTEST_COMMON=(-p no:cacheprovider -v -rfE --durations=15)
if [ "$MODE" = check ]; then PYTEST_COMMON+=(--collect-only -q); fi
if [ "$MODE" = run ] && "$PY" -c "import pytest_timeout" 2>/dev/null; then
    PYTEST_COMMON+=(--timeout=150)  # one hanging test cannot take the whole sub-step
fi
xdist() {
    if [ "$MODE" != check ] && [ "$WORKERS" -gt 1 ] && { [ "$MODE" = dry ] || "$PY" -c "import xdist" 2>/dev/null; }; then
        echo "-n $WORKERS"
    else
        echo "-p no:xdist"
    fi
}

if [ "$STEP" = proof ] && [ "$MODE" != dry ]; then  # what the summary names as not reached if the run is cut
    for row in "${PROOF_BUDGETS[@]}"; do
        if [ "${row%% *}" != setup ]; then echo "${row%% *}"; fi
    done > "$RAW/planned_steps.txt"
fi
if [ "$MODE" != dry ]; then
    # capped: a sick driver can hang CUDA's start; what it printed is in versions.log
    timeout -s KILL 60 "$PY" - > "$RAW/versions.json" 2> "$RAW/versions.log" <<'EOF'
import json, platform, torch, triton
import llm_speed
info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "llm_speed": getattr(llm_speed, "__version__", "?"),
        "cuda_available": torch.cuda.is_available()}
try:  # what Triton's cache keys start with (docs/benchmarks.md: why a cache built elsewhere misses)
    import hashlib
    from triton.runtime.cache import triton_key
    from triton.backends.nvidia.compiler import get_ptxas_version
    info["triton_key_sha256"] = hashlib.sha256(triton_key().encode()).hexdigest()
    info["ptxas"] = get_ptxas_version(90).strip().splitlines()[-1]
except Exception as error:  # a Triton without these names: the summary says so
    info["triton_key_error"] = f"{type(error).__name__}: {error}"
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, compute_capability=f"{props.major}.{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
print(json.dumps(info, indent=1))
EOF
    echo "versions: $(tr -d '\n ' < "$RAW/versions.json")"
    pack
    # Refused without a GPU, after the environment, nvidia-smi and the versions are packed: a lease whose
    # torch sees no GPU is the one that needs them (the versions step's own torch import says it).
    if [ "$MODE" = run ] && [ "${SUITE_ALLOW_CPU:-0}" != 1 ] \
        && ! grep -q '"cuda_available": true' "$RAW/versions.json"; then
        echo "run_gpu_suite.sh: no CUDA GPU visible to $PY (torch.cuda.is_available() is not True:" \
            "versions.json, versions.log and nvidia-smi in $OUT/results.tar.gz)" >&2
        printf "cuda\tno-gpu\t0\t0\n" >> "$RAW/summary.tsv"
        pack
        rm -rf "$RAW" "$RAW.triton-cache"
        cat "$OUT/summary.txt" 2>/dev/null
        exit 2
    fi
fi

# The ~30 GPU tests of the quick proof: attention forward (fp16, bf16, causal or not, GQA, seq 1024) and
# backward against float64, 50-run backward determinism, the tiled forward, packed sequences (their bounds
# in uniform registers: redux.sync, warp_uniform); GEMM in every dtype, the TMA
# kernel across every edge, int8 exact, the linear-layer layout, both paths, the native launch over many
# addresses; a decode step replayed from a CUDA graph. `--check` counts them.
QUICK_FILES=(tests/attention/test_attention_gpu.py tests/attention/test_attention_accuracy.py
    tests/attention/test_attention_varlen.py tests/core/test_warp_uniform.py
    tests/matmul/test_gemm_gpu.py tests/core/test_cuda_graphs_gpu.py)
QUICK_K="(sampled_rows and 128-1024) or (backward_at_scale and 128-1024) or deterministic_over_50 \
or rectangular_causal_prefill or tiled_backward_matches or (square_sizes and 1024) \
or persistent_tma_with_edges or int8_exact or (rectangular_linear_layer and 1000) or both_paths_agree \
or gradients_at_1024 or forward_is_deterministic or one_plan_per_problem_class or native_launch_over \
or replayed_from_a_cuda_graph or mixed_lengths_gqa_against_dense or reduced_loop_bound"

case "$STEP" in
proof)
    CHECK=()
    if [ "$MODE" = check ]; then CHECK=(--check); fi
    # a. correctness: each family in parts, each part its own pytest process with its own timeout, one per
    # core at once, then each candidate launch choice through its families (benchmarks/proof_correctness.py)
    CAP=$(proof_budget correctness)
    sub correctness "$CAP" "$PY" benchmarks/proof_correctness.py "$RAW" --budget-s $((CAP - 12)) \
        --parallel "$CORES" --workers "$WORKERS" "${CHECK[@]}"
    kill_families  # any family the part could not stop (it was killed first) stops holding the GPU here
    # b. the headline: each set one process, each row against its alternatives, each JSON written as soon
    # as its shape is measured (a cut part keeps them)
    for SET in attention gemm fp8 decode; do
        sub "headline_$SET" "$(proof_budget "headline_$SET")" "$PY" benchmarks/gpu_bench.py "proof-$SET" \
            "$RAW" "${CHECK[@]}"
    done
    sub headline_fused "$(proof_budget headline_fused)" "$PY" benchmarks/fused_kernel_time.py \
        --output "$RAW/fused_kernel_time.json" "${CHECK[@]}"
    sub headline_ce "$(proof_budget headline_ce)" "$PY" benchmarks/gpu_bench.py proof-ce "$RAW" "${CHECK[@]}"
    sub headline_train_step "$(proof_budget headline_train_step)" "$PY" benchmarks/gpu_bench.py \
        proof-train-step "$RAW" "${CHECK[@]}"
    # c. A/B with the time left (a final pack's seconds kept back): each candidate against the shipped
    # policy at its own target, rounds interleaved, medians over every round
    AB_CAP=$(proof_budget ab)
    if [ "$MODE" = run ]; then AB_CAP=$((BUDGET - (SECONDS - START) - KILL_GRACE_S - PACK_S)); fi
    # read from the source, not by importing it: an import error is the A/B's failure, not its absence
    if [ "$MODE" = dry ] || grep -q -- "--candidates" benchmarks/attention_ab.py 2>/dev/null; then
        sub ab "$AB_CAP" "$PY" benchmarks/attention_ab.py --candidates --budget-s $((AB_CAP - 20 > 10 ? AB_CAP - 20 : 10)) \
            --json "$RAW/attention_ab.json" "${CHECK[@]}"
    else
        echo "benchmarks/attention_ab.py has no --candidates option (the launch policy's A/B is not in this tree)" \
            | tee "$RAW/ab.log"
        printf "ab\tabsent\t0\t%s\n" "$AB_CAP" >> "$RAW/summary.tsv"
        FAILED=1
    fi
    ;;
quick)
    # doctor compiles its probes while the tests compile theirs: 16 cores, so side by side.
    sub doctor 60 "$PY" -m llm_speed.cli doctor --output "$RAW/doctor.json" &
    DOCTOR=$!
    if [ "$MODE" = dry ]; then wait "$DOCTOR"; fi  # the listing in one order
    # shellcheck disable=SC2046
    sub pytest_quick 140 "$PY" -m pytest "${QUICK_FILES[@]}" -k "$QUICK_K" $(xdist) "${PYTEST_COMMON[@]}" \
        --junitxml="$RAW/pytest_quick.xml"
    wait "$DOCTOR" || FAILED=1
    ;;
tests)
    # shellcheck disable=SC2046
    sub pytest_attention 230 "$PY" -m pytest tests/attention $(xdist) "${PYTEST_COMMON[@]}" \
        --junitxml="$RAW/pytest_attention.xml"
    # shellcheck disable=SC2046
    sub pytest_matmul 150 "$PY" -m pytest tests/matmul $(xdist) "${PYTEST_COMMON[@]}" \
        --junitxml="$RAW/pytest_matmul.xml"
    # shellcheck disable=SC2046
    sub pytest_rest 130 "$PY" -m pytest tests --ignore=tests/attention --ignore=tests/matmul $(xdist) \
        "${PYTEST_COMMON[@]}" --junitxml="$RAW/pytest_rest.xml"
    ;;
bench)
    CHECK=()
    if [ "$MODE" = check ]; then CHECK=(--check); fi
    sub bench_attention 120 "$PY" benchmarks/gpu_bench.py attention "$RAW" "${CHECK[@]}"
    sub bench_gemm 60 "$PY" benchmarks/gpu_bench.py gemm "$RAW" "${CHECK[@]}"
    sub bench_decode 150 "$PY" benchmarks/gpu_bench.py decode "$RAW" "${CHECK[@]}"
    sub bench_fp8 60 "$PY" benchmarks/gpu_bench.py fp8 "$RAW" "${CHECK[@]}"
    sub demo 110 "$PY" benchmarks/gpu_bench.py demo "$RAW" "${CHECK[@]}"
    ;;
fused)
    CHECK=()
    if [ "$MODE" = check ]; then CHECK=(--check); fi
    # caps from the 2026-11-25 H100 run (cold machine): ops 55 s, train-step 48 s, moe cut at 120 s after its
    # 2048-token cases
    sub bench_ops 130 "$PY" benchmarks/gpu_bench.py ops "$RAW" "${CHECK[@]}"
    sub bench_train_step 90 "$PY" benchmarks/gpu_bench.py train-step "$RAW" "${CHECK[@]}"
    sub bench_moe 230 "$PY" benchmarks/gpu_bench.py moe "$RAW" "${CHECK[@]}"
    ;;
probe)
    if [ "$MODE" = check ]; then  # host_in_bench needs CUDA: on the CPU, its command line only
        sub host_in_bench 60 "$PY" benchmarks/host_in_bench.py --help
        sub attention_ab 60 "$PY" benchmarks/attention_ab.py --check
    else
        # every candidate launch choice against the shipped policy at its own target, rounds interleaved,
        # medians over every round (the proof's A/B with the whole of this step's time)
        sub attention_ab 310 "$PY" benchmarks/attention_ab.py --rounds 5 --budget-s 280 \
            --json "$RAW/attention_ab.json"
        sub host_in_bench 120 "$PY" benchmarks/host_in_bench.py --output "$RAW/host_in_bench.json"
    fi
    ;;
esac

if [ "$MODE" = dry ]; then exit 0; fi
trap - TERM INT HUP
pack
rm -rf "$RAW" "$RAW.triton-cache"
echo "step $STEP ($MODE): $((SECONDS - START))s; results in $OUT: summary.txt, summary.json, results.tar.gz"
cat "$OUT/summary.txt" 2>/dev/null
# the device returns the output's last 12,000 characters: the summary's head (problems first) once more
echo "=== the top of summary.txt again ==="
head -n 30 "$OUT/summary.txt" 2>/dev/null
exit "$FAILED"
