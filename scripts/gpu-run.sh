#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .device/ carried (made by scripts/gpu-pack.sh):
#
#   bash scripts/gpu-run.sh [--anchors] [--sanitize] [--model] [--fp8] [--kvcache] [--fp8-cache] [--graphs] [--timeline]
#
# Steps: GPU name; the GPU test binaries (--test-threads=1); the GPU benchmark binary; the host
#   cost of a decode step (decode-host); the batched decode projections, linear_rows against
#   cuBLAS (gpu-linear);
#   --anchors   the anchor benchmark (.device/anchors, from gpu-pack.sh --anchors) through
#               scripts/anchors_timed.py, timed as ours: ANCHOR_TIMING=sustained (default: the
#               mean of back-to-back calls, our benchmark's own method) or events (each call
#               between CUDA events, anchors_bench.py's; the bench step then runs with
#               BENCH_TIMING=events too; docs/benchmarks.md, session 57);
#               env SEQS, HDIMS, PASSES, IMPLS pass through to anchors_bench.py; then
#               scripts/decode_anchor.py (FA3 on the decode-like shapes; BENCH_DECODE=0 skips it)
#   --sanitize  compute-sanitizer memcheck and racecheck on the test binary, with the test filter
#               in env SANITIZE_FILTER (empty: every test; racecheck is slow, so filter)
#   --model     scripts/gpu_model_check.py with the packed generate example: our logits against
#               HF transformers' on random-weight models (SmolLM2-135M, Llama-3.2-1B shapes), then
#               prefill/decode tokens/s next to transformers' (MODEL_CHECK_ARGS: extra arguments)
#   --fp8       the FP8 anchors (scripts/fp8_anchors.py with the wheels of .device/fp8, from
#               gpu-pack.sh --fp8: FA3's fp8 forward and cuDNN's fp8 SDPA, the accuracy protocol's
#               inputs and f64 reference), then the benchmark's fp8 grid and our RMSE on those
#               inputs (BENCH_PASSES=fp8 BENCH_FP8_ACC_DIR=/tmp/fp8_acc; FP8_BENCH_ENV adds env),
#               both timed the same way: FP8_TIMING=sustained (default: back-to-back calls) or
#               events (each call between CUDA events; docs/benchmarks.md, session 56)
#   --kvcache   FA3's flash_attn_with_kvcache on the decode grid (scripts/kvcache_anchor.py, the
#               fa3-fwd wheel of .device/fp8), PyTorch FlexAttention over a page pool (the paged
#               anchor: scripts/flex_paged_anchor.py, the machine's torch; FLEX_SHAPES / FLEX_PAGES
#               narrow it), then the benchmark's kvcache pass on the same grid and its kvcache_fp8
#               pass (e4m3 caches against bf16 on a few decode shapes)
#   --fp8-cache scripts/gpu_fp8_cache.py with the packed generate example: flash-llama's decode
#               tokens/s with an fp8 KV cache against the bf16 cache (random-weight Llama-3.2-1B
#               shape, 8k and 32k context), and the perplexity of both with the default GGUF if
#               models/ holds it (FP8_CACHE_ARGS: extra arguments)
#   --graphs    scripts/gpu_decode_graphs.py with the packed generate example: decode tokens/s and
#               inter-token latency with the CUDA-graph decode step against eager launches, same
#               call (random-weight Llama-3.2-1B shape; GRAPHS_ARGS: extra arguments, e.g.
#               --batches 1,32 --reps 2)
#   --timeline  scripts/gpu_decode_timeline.py with the packed generate example: where the replayed
#               batch-1 decode step's time goes, each kernel in place (CUPTI activity records; needs
#               .device/kt from scripts/build-kernel-trace.sh; TIMELINE_ARGS: extra arguments, e.g.
#               --base-bin /tmp/gb)
# Env: TEST_ARGS / BENCH_ARGS: extra arguments to the test / benchmark binary (e.g. a filter).
#      SKIP: step names not to run, comma-separated (e.g. SKIP=model-tests,train-tests,decode-host).
#      SETTLE_MS: each sustained-timed cell (ours, and the anchors with --anchors or --fp8) runs
#      back to back this many ms before it is timed (its steady state under the power cap).
#      DEADLINE (default 570): seconds from the start after which no step runs any more, and each
#      step is stopped by then, so the summary prints inside a 600 s call; STEP_TIMEOUT (default
#      DEADLINE) caps each step.
# A failing step does not stop the others. Full logs: $OUT/<step>.log (or /tmp/gpu-run/ without
# $OUT), plus summary.txt and anchors_bench.py's anchors.json; at most 8 files come back from $OUT,
# so with both --anchors and --sanitize some logs stay behind. The summary table prints last; the
# exit code is non-zero if any step failed.
set -uo pipefail

ANCHORS=0 SANITIZE=0 MODEL=0 FP8=0 KVCACHE=0 FP8_CACHE=0 GRAPHS=0 TIMELINE=0
for arg in "$@"; do
    case $arg in
        --anchors) ANCHORS=1 ;;
        --fp8) FP8=1 ;;
        --kvcache) KVCACHE=1 ;;
        --fp8-cache) FP8_CACHE=1 ;;
        --graphs) GRAPHS=1 ;;
        --timeline) TIMELINE=1 ;;
        --sanitize) SANITIZE=1 ;;
        --model) MODEL=1 ;;
        -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
        *) echo "gpu-run: unknown argument: $arg (usage: $0 [--anchors] [--sanitize] [--model] [--fp8] [--kvcache] [--fp8-cache] [--graphs] [--timeline])" >&2; exit 2 ;;
    esac
done

START=$SECONDS
DEADLINE=${DEADLINE:-570}
STEP_TIMEOUT=${STEP_TIMEOUT:-$DEADLINE}
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
DEV=$PWD/.device
LOGS=${OUT:-/tmp/gpu-run}
mkdir -p "$LOGS"
BIN=/tmp/gpu-run-bin
mkdir -p "$BIN"

declare -a NAMES=() STATUS=() SECS=()
FAILED=0

# step NAME CMD...: runs CMD with output to the terminal and $LOGS/NAME.log (not with NOLOG=1),
# and records the result.
step() {
    local name=$1 rc t0 left limit status
    shift
    if [[ ,${SKIP:-}, == *,$name,* ]]; then
        NAMES+=("$name") STATUS+=("skipped (SKIP)") SECS+=(0)
        return
    fi
    left=$((DEADLINE - (SECONDS - START)))
    if ((left < 5)); then
        NAMES+=("$name") STATUS+=("SKIP (deadline)") SECS+=(0)
        FAILED=1
        return
    fi
    limit=$((left < STEP_TIMEOUT ? left : STEP_TIMEOUT))
    printf '\n===== %s (limit %d s)\n' "$name" "$limit"
    t0=$SECONDS
    local log=$LOGS/$name.log
    [[ -n ${NOLOG:-} ]] && log=/dev/null
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if ((rc == 0)); then
        status=pass
    elif ((rc == 124 || rc == 137)); then
        status="FAIL (timeout ${limit} s)"
        FAILED=1
    else
        status="FAIL (rc $rc)"
        FAILED=1
    fi
    NAMES+=("$name") STATUS+=("$status") SECS+=($((SECONDS - t0)))
}

# skip_step NAME WHY: records a step that cannot run (missing input) as failed, unless gpu-pack.sh
# --attn left its binary out on purpose or SKIP names it.
skip_step() {
    if [[ ,${SKIP:-}, == *,$1,* ]]; then
        NAMES+=("$1") STATUS+=("skipped (SKIP)") SECS+=(0)
        return
    fi
    if [[ $1 =~ ^(model-tests|train-tests|decode-host|gpu-linear|model-check|fp8-cache)$ ]] && grep -q '^only:' "$DEV/manifest.txt" 2>/dev/null; then
        NAMES+=("$1") STATUS+=("skipped (packed with --attn)") SECS+=(0)
        return
    fi
    echo "gpu-run: $1: $2"
    NAMES+=("$1") STATUS+=("FAIL ($2)") SECS+=(0)
    FAILED=1
}

unxz_to() { # unxz_to SRC.xz DST
    if command -v xz >/dev/null; then
        xz -dc "$1" >"$2"
    else
        python3 -c "import lzma,shutil,sys;shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" "$1" "$2"
    fi && chmod +x "$2"
}

[[ -f $DEV/manifest.txt ]] && cat "$DEV/manifest.txt"
TEST_BIN= BENCH_BIN=
if [[ -f $DEV/gpu-test.xz ]] && unxz_to "$DEV/gpu-test.xz" "$BIN/gpu-test"; then TEST_BIN=$BIN/gpu-test; fi
if [[ -f $DEV/gpu-bench.xz ]] && unxz_to "$DEV/gpu-bench.xz" "$BIN/gpu-bench"; then BENCH_BIN=$BIN/gpu-bench; fi
MODEL_BIN=
if [[ -f $DEV/model-gpu-test.xz ]] && unxz_to "$DEV/model-gpu-test.xz" "$BIN/model-gpu-test"; then MODEL_BIN=$BIN/model-gpu-test; fi
TRAIN_BIN=
if [[ -f $DEV/train-gpu-test.xz ]] && unxz_to "$DEV/train-gpu-test.xz" "$BIN/train-gpu-test"; then TRAIN_BIN=$BIN/train-gpu-test; fi
HOST_BIN= GENERATE_BIN=
if [[ -f $DEV/decode-host.xz ]] && unxz_to "$DEV/decode-host.xz" "$BIN/decode-host"; then HOST_BIN=$BIN/decode-host; fi
LINEAR_BIN=
if [[ -f $DEV/gpu-linear.xz ]] && unxz_to "$DEV/gpu-linear.xz" "$BIN/gpu-linear"; then LINEAR_BIN=$BIN/gpu-linear; fi
if [[ -f $DEV/generate.xz ]] && unxz_to "$DEV/generate.xz" "$BIN/generate"; then GENERATE_BIN=$BIN/generate; fi

NOLOG=1 step gpu nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
GPU_NAME=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n1)
# Clock, temperature and throttle reasons, at the start and in the summary: one lent machine ran
# every kernel at half speed (SW thermal slowdown, 85 C) and its numbers looked like a regression.
gpu_state() {
    nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw,clocks_event_reasons.active \
        --format=csv,noheader 2>/dev/null | head -n1
}
# Thermal or hardware slowdown among the active reasons (bits 0x08, 0x20, 0x40).
throttled() { [[ -n $1 ]] && (($(awk -F', ' '{print $4}' <<<"$1") & 0x68)); }
GPU_STATE_START=$(gpu_state)
echo "GPU state (SM clock, temperature, power, throttle reasons): ${GPU_STATE_START:-?}"

# shellcheck disable=SC2086 # TEST_ARGS / BENCH_ARGS / SANITIZE_FILTER are word lists
if [[ -n $TEST_BIN ]]; then
    step tests "$TEST_BIN" --test-threads=1 ${TEST_ARGS:-}
else
    skip_step tests "no .device/gpu-test.xz: run scripts/gpu-pack.sh and carry .device"
fi

# flash-llama's fused kernels and models (crates/model/tests/gpu.rs).
if [[ -n $MODEL_BIN ]]; then
    step model-tests "$MODEL_BIN" --test-threads=1
else
    skip_step model-tests "no .device/model-gpu-test.xz: run scripts/gpu-pack.sh and carry .device"
fi
# flash-llama's differentiable training ops (crates/model/tests/gpu_train.rs).
if [[ -n $TRAIN_BIN ]]; then
    step train-tests "$TRAIN_BIN" --test-threads=1
else
    skip_step train-tests "no .device/train-gpu-test.xz: run scripts/gpu-pack.sh and carry .device"
fi

# With --anchors, ours timed as the anchors are (ANCHOR_TIMING).
ANCHOR_TIMING=${ANCHOR_TIMING:-sustained}
[[ $ANCHOR_TIMING == sustained || $ANCHOR_TIMING == events ]] || { echo "gpu-run: ANCHOR_TIMING must be sustained or events" >&2; exit 2; }
if ((ANCHORS)) && [[ $ANCHOR_TIMING == events ]]; then export BENCH_TIMING=events; fi
# SETTLE_MS=n: sustained timings run each cell back to back for n ms first, ours and the anchors'
# (--anchors, --fp8), so that every cell is timed at the GPU's steady state under load.
if [[ -n ${SETTLE_MS:-} ]]; then export SETTLE_MS BENCH_SETTLE_MS=$SETTLE_MS; fi
if [[ -n $BENCH_BIN ]]; then
    step bench "$BENCH_BIN" ${BENCH_ARGS:-}
else
    skip_step bench "no .device/gpu-bench.xz: run scripts/gpu-pack.sh and carry .device"
fi

# Host cost of a batch-1 decode step of the Llama-3.2-1B shape and of its ops.
if [[ -n $HOST_BIN ]]; then
    step decode-host "$HOST_BIN"
else
    skip_step decode-host "no .device/decode-host.xz: run scripts/gpu-pack.sh and carry .device"
fi

# linear_rows against cuBLAS on the 1B shape's projections at 2-64 tokens.
if [[ -n $LINEAR_BIN ]]; then
    step gpu-linear "$LINEAR_BIN"
else
    skip_step gpu-linear "no .device/gpu-linear.xz: run scripts/gpu-pack.sh and carry .device"
fi

if ((MODEL)); then
    if [[ -n $GENERATE_BIN ]]; then
        step model-check python3 scripts/gpu_model_check.py --bin "$GENERATE_BIN" \
            --work /tmp/flash-llama-check --out "$LOGS" ${MODEL_CHECK_ARGS:-}
    else
        skip_step model-check "no .device/generate.xz: run scripts/gpu-pack.sh and carry .device"
    fi
fi

if ((GRAPHS)); then
    if [[ -n $GENERATE_BIN ]]; then
        # shellcheck disable=SC2086 # GRAPHS_ARGS is a word list
        step graphs python3 scripts/gpu_decode_graphs.py --bin "$GENERATE_BIN" --work /tmp/flash-llama-check \
            --deadline $((DEADLINE - (SECONDS - START) - 60)) ${GRAPHS_ARGS:-}
    else
        skip_step graphs "no .device/generate.xz: run scripts/gpu-pack.sh and carry .device"
    fi
fi

if ((TIMELINE)); then
    if [[ -n $GENERATE_BIN && -f $DEV/kt/libkernel_trace.so ]]; then
        # shellcheck disable=SC2086 # TIMELINE_ARGS is a word list
        step timeline python3 scripts/gpu_decode_timeline.py --bin "$GENERATE_BIN" --work /tmp/flash-llama-check \
            --tracer "$DEV/kt/libkernel_trace.so" --out "$LOGS" ${TIMELINE_ARGS:-}
    else
        skip_step timeline "no .device/generate.xz or .device/kt: run scripts/gpu-pack.sh and scripts/build-kernel-trace.sh"
    fi
fi

if ((FP8_CACHE)); then
    if [[ -n $GENERATE_BIN ]]; then
        # shellcheck disable=SC2086 # FP8_CACHE_ARGS is a word list
        step fp8-cache python3 scripts/gpu_fp8_cache.py --bin "$GENERATE_BIN" \
            --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf --deadline $((DEADLINE - (SECONDS - START) - 90)) ${FP8_CACHE_ARGS:-}
    else
        skip_step fp8-cache "no .device/generate.xz: run scripts/gpu-pack.sh and carry .device"
    fi
fi

if ((ANCHORS)); then
    shopt -s nullglob
    wheels=("$DEV"/anchors/*.whl)
    shopt -u nullglob
    if [[ -f $DEV/anchors/anchors_bench.py && ${#wheels[@]} -gt 0 ]]; then
        # SEQS, HDIMS, PASSES, IMPLS come through the environment; the script also writes
        # $OUT/anchors.json.
        step anchors env TIMING_MODE="$ANCHOR_TIMING" bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${@:2}" &&
            PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 exec python3 scripts/anchors_timed.py "$1"' \
            bash "$DEV/anchors/anchors_bench.py" "${wheels[@]}"
        # FA3 on the benchmark's decode-like shapes (split-KV), with the wheels installed above.
        [[ ${BENCH_DECODE:-1} != 0 ]] && step decode-anchor bash -c \
            'PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 exec python3 scripts/decode_anchor.py'
    else
        skip_step anchors "no .device/anchors: run scripts/gpu-pack.sh --anchors"
    fi
fi

if ((FP8)); then
    shopt -s nullglob
    wheels=("$DEV"/fp8/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} > 0)); then
        step fp8-anchors env TIMING_MODE="${FP8_TIMING:-sustained}" bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fp8 "$@" &&
            PYTHONPATH=/tmp/site-fp8${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ACC_DIR=/tmp/fp8_acc exec python3 scripts/fp8_anchors.py' \
            bash "${wheels[@]}"
    else
        skip_step fp8-anchors "no .device/fp8: run scripts/gpu-pack.sh --fp8"
    fi
    if [[ -n $BENCH_BIN ]]; then
        # shellcheck disable=SC2086 # FP8_BENCH_ENV is a list of NAME=VALUE words
        step fp8-bench env BENCH_TIMING="${FP8_TIMING:-sustained}" BENCH_PASSES=fp8 BENCH_DECODE=0 BENCH_FP8_ACC_DIR=/tmp/fp8_acc ${FP8_BENCH_ENV:-} "$BENCH_BIN"
    fi
fi

if ((KVCACHE)); then
    shopt -s nullglob
    wheels=("$DEV"/fp8/fa3_fwd*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} > 0)); then
        step kvcache-anchor bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-kv "$@" &&
            PYTHONPATH=/tmp/site-kv${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 exec python3 scripts/kvcache_anchor.py' \
            bash "${wheels[@]}"
    else
        skip_step kvcache-anchor "no .device/fp8/fa3_fwd*.whl: run scripts/gpu-pack.sh --fp8"
    fi
    # FA3's wheel has paged KV compiled out: FlexAttention is the paged anchor (torch's own).
    step kvcache-flex env PYTHONUNBUFFERED=1 ${FLEX_SHAPES:+SHAPES=$FLEX_SHAPES} ${FLEX_PAGES:+PAGES=$FLEX_PAGES} \
        python3 scripts/flex_paged_anchor.py
    if [[ -n $BENCH_BIN ]]; then
        step kvcache-bench env BENCH_PASSES=kvcache,kvcache_fp8 BENCH_DECODE=0 "$BENCH_BIN"
    fi
fi

if ((SANITIZE)); then
    CS=$(command -v compute-sanitizer ||
        ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
            /usr/local/cuda*/compute-sanitizer/compute-sanitizer 2>/dev/null | head -n1)
    if [[ -z $CS ]]; then
        skip_step sanitize "compute-sanitizer not found"
    elif [[ -z $TEST_BIN ]]; then
        skip_step sanitize "no test binary"
    else
        echo "compute-sanitizer: $CS; filter: '${SANITIZE_FILTER:-}' (empty: all tests)"
        step memcheck "$CS" --tool memcheck --error-exitcode 1 \
            "$TEST_BIN" --test-threads=1 ${SANITIZE_FILTER:-}
        step racecheck "$CS" --tool racecheck --racecheck-report analysis --error-exitcode 1 \
            "$TEST_BIN" --test-threads=1 ${SANITIZE_FILTER:-}
    fi
fi

{
    printf '\n===== summary (%d s in all, logs in %s)\n' $((SECONDS - START)) "$LOGS"
    echo "GPU: ${GPU_NAME:-?}"
    GPU_STATE_END=$(gpu_state)
    echo "GPU state at start: ${GPU_STATE_START:-?}; now: ${GPU_STATE_END:-?}"
    if throttled "$GPU_STATE_START" || throttled "$GPU_STATE_END"; then
        echo "WARNING: thermal/hardware slowdown active: timings of this call are not comparable"
    fi
    [[ -f $DEV/manifest.txt ]] && grep -E '^(packed|commit):' "$DEV/manifest.txt"
    printf '%-16s %-40s %6s\n' step result seconds
    for i in "${!NAMES[@]}"; do
        printf '%-16s %-40s %6d\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}"
    done
    printf '%s\n' "$([[ $FAILED == 0 ]] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
} | tee "$LOGS/summary.txt"
exit $FAILED
