#!/usr/bin/env bash
# Builds, here (no GPU needed), what scripts/gpu-run.sh runs on the GPU machine, into .device/
# (git-ignored): the GPU test binaries (tests/gpu.rs, crates/model/tests/gpu.rs and gpu_train.rs),
# the GPU benchmark binaries (crates/flash-attn/benches/gpu_attention.rs,
# crates/model/benches/decode_host.rs and gpu_linear.rs) and the generate and serve examples built for the GPU (for
# scripts/gpu_model_check.py, gpu_fp8_cache.py and gpu-serve-load.sh), stripped and xz-compressed.
#
#   scripts/gpu-pack.sh [--anchors] [--fp8] [--attn] [--baseline REV] [--variant NAME=FLAGS]...
#   scripts/gpu-pack.sh --multi
#
# --multi    only the multi-GPU binaries: the train, generate and ring_attention examples built
#            with `--features nccl` (.device/train-nccl.xz, generate-nccl.xz, ring-attention.xz)
#            and the training ops' GPU tests (train-gpu-test.xz), for
#            scripts/gpu-multi.sh on a machine with several GPUs.
# --attn     only the attention test and benchmark binaries (a few minutes instead of ~12 when the
#            model crates are cold); gpu-run.sh then reports the model steps as not packed.
# --baseline REV  also the benchmark binary of git revision REV, as .device-base/gpu-bench.xz for
#            scripts/gpu-ab.sh (carry [".device", ".device-base"]): an A/B of the two builds in one
#            call. Built in a worktree under target/baseline/ with a target dir of its own (cargo's
#            hashes ignore where a workspace lives, so a shared one would overwrite this build).
# --variant NAME=FLAGS  also the working tree's benchmark binary with the kernels compiled with
#            FA3_NVCC_FLAGS=FLAGS (e.g. `fma3=-DFA3_EXP_EVERY=3`, for a switch the kernel source reads
#            with #ifndef/#define while an experiment lasts), as .device-base/gpu-bench-NAME.xz;
#            repeatable. scripts/gpu-ab.sh runs every packed build alternating in one call.
# --anchors  also puts the anchor benchmark (../shared/anchors/anchors_bench.py) and its wheels
#            (../shared/anchors/get-wheels.sh, about 50 MB) into .device/anchors/.
# --fp8      puts the FP8 anchors' wheels (scripts/get-fp8-wheels.sh: fa3-fwd, cudnn-frontend,
#            about 28 MB) into .device/fp8/ for gpu-run.sh --fp8 (too big to go with --anchors).
#
# The toolkit comes from $CUDA_DIR (default ~/.cache/flash-attn3/cuda, as in .ci/run), installed there by
# scripts/install-cuda-toolkit.sh if absent. Then, with the device tool:
#   run  carry [".device"]  command "bash scripts/gpu-run.sh [--anchors] [--sanitize]"
# What travels (working tree + .device) must stay under 64 MiB: the sizes are printed last.
set -euo pipefail

log() { printf '[gpu-pack] %s\n' "$*" >&2; }
die() { printf '[gpu-pack] error: %s\n' "$*" >&2; exit 1; }

ANCHORS=0 FP8=0 ATTN_ONLY=0 MULTI=0 BASELINE= VARIANTS=()
while (($#)); do
    case $1 in
        --anchors) ANCHORS=1 ;;
        --fp8) FP8=1 ;;
        --attn) ATTN_ONLY=1 ;;
        --multi) MULTI=1 ;;
        --baseline) BASELINE=${2:?--baseline needs a git revision}; shift ;;
        --variant)
            [[ ${2:-} =~ ^[A-Za-z0-9_-]+=.+$ ]] || die "--variant needs NAME=FLAGS (a name of letters, digits, - or _), got '${2:-}'"
            VARIANTS+=("$2"); shift ;;
        -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
        *) die "unknown argument: $1 (usage: $0 [--anchors] [--fp8] [--attn] [--baseline REV] [--variant NAME=FLAGS]...)" ;;
    esac
    shift
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
DEV=$REPO/.device
SHARED=$(cd "$REPO/.." && pwd)/shared
LIMIT=$((64 * 1024 * 1024))

git check-ignore -q .device/x 2>/dev/null || die ".device/ is not git-ignored: add /.device/ to .gitignore"
for tool in cargo python3 strip xz; do
    command -v $tool >/dev/null || die "$tool not found"
done

CUDA_DIR=${CUDA_DIR:-$HOME/.cache/flash-attn3/cuda}
env_lines=$("$REPO/scripts/install-cuda-toolkit.sh" "$CUDA_DIR") || die "toolkit install into $CUDA_DIR failed"
eval "$env_lines"
log "CUDA_HOME=$CUDA_HOME"

# build_exe OUTVAR TARGET_NAME CARGO_ARGS...: runs cargo with JSON messages, picks the executable
# of TARGET_NAME out of them (diagnostics still render on stderr).
build_exe() {
    local var=$1 name=$2 json exe t0=$SECONDS
    shift 2
    log "cargo $*"
    json=$(cargo "$@" --message-format=json-render-diagnostics) || die "cargo $* failed"
    exe=$(printf '%s\n' "$json" | python3 -c '
import json, sys
name = sys.argv[1]
exes = []
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == name and m.get("executable"):
        exes.append(m["executable"])
print(exes[-1] if exes else "")
' "$name")
    [[ -n $exe && -x $exe ]] || die "no executable for target $name in cargo's output"
    log "built $exe in $((SECONDS - t0)) s"
    printf -v "$var" '%s' "$exe"
}

if ((MULTI)); then
    build_exe TRAIN_NCCL_EXE train build --release -p flash-attn3-examples --features nccl --example train
    build_exe GENERATE_NCCL_EXE generate build --release -p flash-attn3-examples --features nccl --example generate
    build_exe RING_EXE ring_attention build --release -p flash-attn3-examples --features nccl --example ring_attention
    build_exe TRAIN_TEST_EXE gpu_train test --release -p flash-llama --features cuda --test gpu_train --no-run
    mkdir -p "$DEV"
    rm -f "$DEV"/*.xz "$DEV/manifest.txt"
    for pair in "$TRAIN_NCCL_EXE:train-nccl" "$GENERATE_NCCL_EXE:generate-nccl" "$RING_EXE:ring-attention" "$TRAIN_TEST_EXE:train-gpu-test"; do
        cp -f "${pair%%:*}" "$DEV/${pair##*:}.tmp"
        strip --strip-debug "$DEV/${pair##*:}.tmp"
        xz -T2 -6 -f -c "$DEV/${pair##*:}.tmp" >"$DEV/${pair##*:}.xz"
        rm -f "$DEV/${pair##*:}.tmp"
        log "packed ${pair##*:}.xz ($(du -h "$DEV/${pair##*:}.xz" | cut -f1))"
    done
    {
        echo "packed:  $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
        echo "commit:  $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
        echo "only:    multi-GPU (gpu-pack.sh --multi): train-nccl, generate-nccl, ring-attention, train-gpu-test"
    } >"$DEV/manifest.txt"
    log "run: bash scripts/gpu-multi.sh (carry .device/{train-nccl,generate-nccl,ring-attention,train-gpu-test}.xz and .device/manifest.txt)"
    exit 0
fi
build_exe TEST_EXE gpu test --release -p flash-attn3-tests --features cuda --test gpu --no-run
build_exe BENCH_EXE gpu_attention bench -p flash-attn3 --features cuda --bench gpu_attention --no-run
if ((!ATTN_ONLY)); then
    build_exe MODEL_TEST_EXE gpu test --release -p flash-llama --features cuda --test gpu --no-run
    build_exe GENERATE_NCCL_EXE generate build --release -p flash-attn3-examples --features nccl --example generate
    build_exe RING_EXE ring_attention build --release -p flash-attn3-examples --features nccl --example ring_attention
    build_exe TRAIN_TEST_EXE gpu_train test --release -p flash-llama --features cuda --test gpu_train --no-run
    build_exe HOST_BENCH_EXE decode_host bench -p flash-llama --features cuda --bench decode_host --no-run
    build_exe LINEAR_BENCH_EXE gpu_linear bench -p flash-llama --features cuda --bench gpu_linear --no-run
    build_exe GENERATE_EXE generate build --release -p flash-attn3-examples --features cuda --example generate
    build_exe SERVE_EXE serve build --release -p flash-attn3-examples --features cuda --example serve
fi
if [[ -n $BASELINE ]]; then
    BASE_REV=$(git rev-parse --short "$BASELINE^{commit}") || die "--baseline $BASELINE: no such revision"
    BASE_TREE=$REPO/target/baseline/$BASE_REV
    [[ -d $BASE_TREE ]] || git worktree add --detach "$BASE_TREE" "$BASE_REV" >&2 || die "git worktree add $BASE_TREE failed"
    BASE_EXE=$(
        cd "$BASE_TREE" &&
            CARGO_TARGET_DIR=$REPO/target/baseline/target build_exe base_exe gpu_attention bench -p flash-attn3 --features cuda --bench gpu_attention --no-run &&
            echo "$base_exe"
    ) || die "baseline build failed"
fi

mkdir -p "$DEV"
rm -f "$DEV"/*.xz # what is not packed below must not travel from an older pack
pack() { # pack SRC NAME: strip and compress SRC into .device/NAME.xz
    local src=$1 dst=$DEV/$2 t0=$SECONDS
    cp -f "$src" "$dst.tmp"
    strip --strip-debug "$dst.tmp" # plain strip fails on the .nv_fatbin section
    xz -T2 -6 -f -c "$dst.tmp" >"$dst.xz.tmp"
    rm -f "$dst.tmp"
    mv -f "$dst.xz.tmp" "$dst.xz"
    log "packed $2.xz ($(du -h "$src" | cut -f1) -> $(du -h "$dst.xz" | cut -f1), $((SECONDS - t0)) s)"
}
pack "$TEST_EXE" gpu-test
pack "$BENCH_EXE" gpu-bench
if ((!ATTN_ONLY)); then
    pack "$MODEL_TEST_EXE" model-gpu-test
    pack "$TRAIN_TEST_EXE" train-gpu-test
    pack "$HOST_BENCH_EXE" decode-host
    pack "$LINEAR_BENCH_EXE" gpu-linear
    pack "$GENERATE_EXE" generate
    pack "$SERVE_EXE" serve
fi
if [[ -n $BASELINE || ${#VARIANTS[@]} -gt 0 ]]; then
    mkdir -p "$REPO/.device-base"
    rm -f "$REPO"/.device-base/gpu-bench*.xz "$REPO/.device-base/manifest.txt"
fi
if [[ -n $BASELINE ]]; then
    DEV=$REPO/.device-base pack "$BASE_EXE" gpu-bench
    echo "baseline: $BASE_REV ($(git log -1 --format=%s "$BASE_REV" | cut -c1-60))" >>"$REPO/.device-base/manifest.txt"
fi
# Variants last: each rebuilds the working tree's kernels in the same target dir (the main
# binaries above are already packed). The next plain build compiles them again without the flags.
for variant in "${VARIANTS[@]}"; do
    name=${variant%%=*} flags=${variant#*=}
    FA3_NVCC_FLAGS=$flags build_exe VARIANT_EXE gpu_attention bench -p flash-attn3 --features cuda --bench gpu_attention --no-run
    DEV=$REPO/.device-base pack "$VARIANT_EXE" "gpu-bench-$name"
    echo "variant: $name (FA3_NVCC_FLAGS=$flags)" >>"$REPO/.device-base/manifest.txt"
done

{
    echo "packed:  $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "commit:  $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "nvcc:    $(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*')"
    echo "test:    $(basename "$TEST_EXE")"
    echo "bench:   $(basename "$BENCH_EXE")"
    if ((ATTN_ONLY)); then
        echo "only:    attention (gpu-pack.sh --attn)"
    else
        echo "model:   $(basename "$MODEL_TEST_EXE")"
        echo "train:   $(basename "$TRAIN_TEST_EXE")"
        echo "host:    $(basename "$HOST_BENCH_EXE")"
        echo "generate: $(basename "$GENERATE_EXE")"
        echo "serve:   $(basename "$SERVE_EXE")"
    fi
} >"$DEV/manifest.txt"

if ((ANCHORS)); then
    [[ -f $SHARED/anchors/anchors_bench.py && -x $SHARED/anchors/get-wheels.sh ]] ||
        die "$SHARED/anchors/{anchors_bench.py,get-wheels.sh} missing"
    mkdir -p "$DEV/anchors"
    cp -f "$SHARED/anchors/anchors_bench.py" "$DEV/anchors/"
    log "downloading the anchor wheels into .device/anchors"
    "$SHARED/anchors/get-wheels.sh" "$DEV/anchors" >&2 || die "get-wheels.sh failed"
else
    rm -rf "$DEV/anchors" # only carry anchors when asked for
fi
if ((FP8)); then
    log "downloading the fp8 anchor wheels into .device/fp8"
    "$REPO/scripts/get-fp8-wheels.sh" "$DEV/fp8" >&2 || die "get-fp8-wheels.sh failed"
else
    rm -rf "$DEV/fp8"
fi

# Sizes: what travels is the working tree (tracked + untracked-not-ignored files) plus .device.
tree_bytes=$( (git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null || true) | tail -n1 | cut -f1)
dev_bytes=$(du -sb "$DEV" | cut -f1)
[[ -n $BASELINE || ${#VARIANTS[@]} -gt 0 ]] && dev_bytes=$((dev_bytes + $(du -sb "$REPO/.device-base" | cut -f1)))
total=$((tree_bytes + dev_bytes))
echo "== .device contents"
(cd "$DEV" && find . -type f -printf '%s\t%p\n' | sort -k2 | awk -F'\t' '{printf "%10.2f MiB  %s\n", $1/1048576, $2}')
mib() { awk -v b="$1" 'BEGIN { printf "%10.2f MiB", b / 1048576 }'; }
echo "$(mib "$dev_bytes")  .device total"
echo "$(mib "$tree_bytes")  working tree (tracked + untracked, not ignored)"
echo "$(mib "$total")  carried in all (limit 64 MiB)"
((total < LIMIT)) || die "what would travel is over 64 MiB"
