#!/usr/bin/env bash
# Downloads, here (PyPI reachable), the wheels that scripts/fp8_anchors.py needs on the GPU machine
# (Python 3.12, PyTorch 2.11 cu130 with its cuDNN 9.19, no network) into DIR (default .device/fp8):
#
#   scripts/get-fp8-wheels.sh [DIR]
#
#   fa3-fwd 0.0.3                 FlashAttention-3 forward as a PyTorch extension (abi3, stable torch
#                                 ABI, sm90a). Built with FP8 on: e4m3 kernels for head dims
#                                 64/96/128/192/256, q/k/v_descale of shape (batch, heads_k), bf16
#                                 output. The same wheel as ../shared/anchors/get-wheels.sh. ~27.6 MB.
#   nvidia-cudnn-frontend 1.18.0  cuDNN's graph API in Python (pybind module, no Python deps); its
#                                 pygraph.sdpa_fp8 drives the cuDNN backend that torch already loads
#                                 (nvidia-cudnn-cu13 9.19). Released in the same month as cuDNN 9.19;
#                                 later releases pull in nvidia-cutlass-dsl and grow to 11 MB. ~2.2 MB.
#
# On the GPU machine (carry DIR, e.g. .device with DIR=.device/fp8):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site python3 scripts/fp8_anchors.py
set -euo pipefail

case ${1:-} in
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;
esac
DIR=${1:-.device/fp8}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    -d "$DIR" fa3-fwd==0.0.3 nvidia-cudnn-frontend==1.18.0
(cd "$DIR" && ls -l -- *.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}')
du -cb "$DIR"/*.whl | tail -n1 | awk '{printf "%8.2f MiB  total\n", $1 / 1048576}'
