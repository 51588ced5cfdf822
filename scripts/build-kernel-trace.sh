#!/usr/bin/env bash
# Builds, here (no GPU needed), the CUPTI kernel tracer that scripts/gpu_decode_timeline.py injects
# into `generate` on the GPU machine (scripts/kernel_trace.cpp, loaded through
# CUDA_INJECTION64_PATH): .device/kt/libkernel_trace.so with CUPTI's library beside it.
#
#   scripts/build-kernel-trace.sh
#
# CUPTI's headers and library come from PyPI's nvidia-cuda-cupti 13.0 (the toolkit's release, so
# its activity records match the driver's), unpacked once under $CUPTI_DIR (default
# ~/.cache/flash-attn3/cupti). Needs g++ and pip. Then, with .device carried:
#   bash scripts/gpu-run.sh --timeline
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CUPTI_DIR=${CUPTI_DIR:-$HOME/.cache/flash-attn3/cupti}
if [[ ! -f $CUPTI_DIR/nvidia/cu13/include/cupti.h ]]; then
    mkdir -p "$CUPTI_DIR"
    pip download --quiet --no-deps -d "$CUPTI_DIR" "nvidia-cuda-cupti==13.0.*"
    (cd "$CUPTI_DIR" && python3 -m zipfile -e nvidia_cuda_cupti-*.whl .)
fi
CUDA_INCLUDE=${CUDA_DIR:-$HOME/.cache/flash-attn3/cuda}/nvidia/cu13/include
[[ -f $CUDA_INCLUDE/cuda.h ]] || { echo "build-kernel-trace: no $CUDA_INCLUDE/cuda.h: run scripts/install-cuda-toolkit.sh" >&2; exit 2; }
OUT=$REPO/.device/kt
mkdir -p "$OUT"
g++ -O2 -shared -fPIC -o "$OUT/libkernel_trace.so" "$REPO/scripts/kernel_trace.cpp" \
    -I"$CUPTI_DIR/nvidia/cu13/include" -I"$CUDA_INCLUDE" \
    -L"$CUPTI_DIR/nvidia/cu13/lib" -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
cp "$CUPTI_DIR/nvidia/cu13/lib/libcupti.so.13" "$OUT/"
du -sh "$OUT"
