#!/usr/bin/env bash
# Installs a CUDA 13.0 toolkit from PyPI into DIR, usable for `cargo build --features cuda` on a
# machine with no system CUDA and no GPU (development machines, CI).
#
#   eval "$(scripts/install-cuda-toolkit.sh DIR)"      # DIR defaults to $CUDA_DIR or ~/.cache/flash-attn3/cuda
#
# What it does (idempotent: a second run only re-checks, in about a second):
#   1. pip-installs cuda-toolkit[nvcc,cudart,cublas,curand,nvrtc,cccl,crt]==13.0.3.0 into DIR, plus
#      cuobjdump and nvdisasm (their own wheels, nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm: the
#      cuda-toolkit meta-package has no extra for them and PyPI has them from 13.2 on only; a newer
#      cuobjdump reads sm_90a cubins made by nvcc 13.0). Toolkit root: DIR/nvidia/cu13.
#   2. adds the unversioned soname symlinks the linker wants (libcublas.so -> libcublas.so.13, ...).
#   3. builds lib/stubs/libcuda.so (soname libcuda.so.1): a dummy for every driver entry point, so
#      that candle's cudarc (feature dynamic-linking, `-lcuda`) links. It never runs: the GPU
#      machine's real libcuda.so.1 is loaded at run time.
#   4. the same for lib/stubs/libnccl.so (soname libnccl.so.2), for builds with `--features nccl`.
# Progress goes to stderr; stdout carries only the `export ...` lines.
set -euo pipefail

TOOLKIT_SPEC="cuda-toolkit[nvcc,cudart,cublas,curand,nvrtc,cccl,crt]==13.0.3.0"
# Binary-inspection tools (cuobjdump -sass, nvdisasm): not part of the cuda-toolkit 13.0 extras.
EXTRA_SPECS=(nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51)

log() { printf '[install-cuda-toolkit] %s\n' "$*" >&2; }
die() { printf '[install-cuda-toolkit] error: %s\n' "$*" >&2; exit 1; }

DIR=${1:-${CUDA_DIR:-$HOME/.cache/flash-attn3/cuda}}
[[ -n $DIR ]] || die "usage: $0 DIR"
mkdir -p "$DIR" || die "cannot create $DIR"
DIR=$(cd "$DIR" && pwd)
ROOT=$DIR/nvidia/cu13

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (needed for pip)"
pip_install() { # pip_install TARGET SPEC...
    local target=$1; shift
    PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
        --target "$target" "$@" >&2 || die "pip install --target $target $* failed"
}

# 1. The toolkit.
if [[ -x $ROOT/bin/nvcc ]]; then
    log "toolkit already present at $ROOT"
else
    log "pip-installing $TOOLKIT_SPEC ${EXTRA_SPECS[*]} into $DIR (about 1.2 GB)"
    t0=$SECONDS
    pip_install "$DIR" "$TOOLKIT_SPEC" "${EXTRA_SPECS[@]}"
    [[ -x $ROOT/bin/nvcc ]] || die "pip finished but $ROOT/bin/nvcc is missing"
    log "toolkit installed in $((SECONDS - t0)) s"
fi

# 1b. cuobjdump / nvdisasm for a toolkit installed without them (pip --target cannot add into an
# existing nvidia/ folder without --upgrade, which would replace the folder whole: go through a
# temporary target and copy the binaries).
if [[ ! -x $ROOT/bin/cuobjdump || ! -x $ROOT/bin/nvdisasm ]]; then
    log "adding cuobjdump and nvdisasm (${EXTRA_SPECS[*]})"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    pip_install "$tmp" "${EXTRA_SPECS[@]}"
    for tool in cuobjdump nvdisasm; do
        [[ -x $tmp/nvidia/cu13/bin/$tool ]] || die "$tool missing from its wheel"
        cp -f "$tmp/nvidia/cu13/bin/$tool" "$ROOT/bin/$tool"
    done
    rm -rf "$tmp"
    trap - EXIT
fi

# 2. Unversioned soname links (the wheels ship libfoo.so.N only).
lib=$ROOT/lib
[[ -d $lib ]] || die "$lib missing"
for name in cublas cublasLt nvrtc cudart curand; do
    # The real file: libNAME.so.<major>, e.g. libcublas.so.13, libcurand.so.10.
    real=$(cd "$lib" && ls "lib$name.so."* 2>/dev/null | grep -E "^lib$name\.so\.[0-9]+$" | sort -V | tail -n1 || true)
    [[ -n $real ]] || die "no $lib/lib$name.so.<major> found"
    if [[ $(readlink "$lib/lib$name.so" 2>/dev/null || true) != "$real" ]]; then
        ln -sfn "$real" "$lib/lib$name.so"
        log "linked lib/lib$name.so -> $real"
    fi
done

# 3. The libcuda stub.
stub=$lib/stubs/libcuda.so
if [[ -f $stub ]] && readelf -d "$stub" 2>/dev/null | grep -q 'SONAME.*libcuda\.so\.1'; then
    log "libcuda stub already present at $stub"
else
    command -v gcc >/dev/null || die "gcc not found (needed to build the libcuda stub)"
    header=$ROOT/include/cuda.h
    [[ -f $header ]] || die "$header missing"
    # cudarc's driver bindings list every entry point it may link: they need the registry sources.
    shopt -s nullglob
    cudarc_srcs=("$HOME"/.cargo/registry/src/*/cudarc-*/src/driver/sys)
    if ((${#cudarc_srcs[@]} == 0)); then
        script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
        if command -v cargo >/dev/null && [[ -f $script_dir/../Cargo.lock ]]; then
            log "no cudarc sources in ~/.cargo/registry: running cargo fetch"
            (cd "$script_dir/.." && cargo fetch >&2) || die "cargo fetch failed"
            cudarc_srcs=("$HOME"/.cargo/registry/src/*/cudarc-*/src/driver/sys)
        fi
    fi
    shopt -u nullglob
    ((${#cudarc_srcs[@]} > 0)) || log "warning: no cudarc sources found; stub built from cuda.h alone"

    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    {
        grep -ohE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' "$header"
        gcc -E -P -I"$ROOT/include" "$header" | grep -ohE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\('
        if ((${#cudarc_srcs[@]} > 0)); then
            grep -rohE '\bfn[[:space:]]+cu[A-Z][A-Za-z0-9_]*[[:space:]]*[(<]' "${cudarc_srcs[@]}" |
                sed -E 's/^fn[[:space:]]+//'
        fi
    } | sed -E 's/[[:space:]]*[(<]$//' | sort -u >"$work/symbols"
    n=$(wc -l <"$work/symbols")
    ((n > 100)) || die "only $n driver symbols found: cuda.h or the cudarc sources look wrong"
    sed -E 's/.*/void &(void) {}/' "$work/symbols" >"$work/stub.c"
    mkdir -p "$lib/stubs"
    gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$work/libcuda.so" "$work/stub.c" ||
        die "building the libcuda stub failed"
    mv -f "$work/libcuda.so" "$stub"
    rm -rf "$work"
    trap - EXIT
    log "built $stub with $n dummy entry points"
fi

# 4. The libnccl stub, for builds with the `nccl` feature (multi-GPU): cudarc links -lnccl. Like
# the libcuda stub it never runs: the GPU machine's real libnccl.so.2 (PyTorch's nvidia-nccl
# wheel) is found through LD_LIBRARY_PATH at run time (scripts/gpu-multi.sh sets it).
nccl_stub=$lib/stubs/libnccl.so
if [[ -f $nccl_stub ]] && readelf -d "$nccl_stub" 2>/dev/null | grep -q 'SONAME.*libnccl\.so\.2'; then
    log "libnccl stub already present at $nccl_stub"
else
    shopt -s nullglob
    nccl_srcs=("$HOME"/.cargo/registry/src/*/cudarc-*/src/nccl/sys)
    if ((${#nccl_srcs[@]} == 0)); then
        script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
        if command -v cargo >/dev/null && [[ -f $script_dir/../Cargo.lock ]]; then
            log "no cudarc sources in ~/.cargo/registry: running cargo fetch"
            (cd "$script_dir/.." && cargo fetch >&2) || die "cargo fetch failed"
            nccl_srcs=("$HOME"/.cargo/registry/src/*/cudarc-*/src/nccl/sys)
        fi
    fi
    shopt -u nullglob
    if ((${#nccl_srcs[@]} == 0)); then
        log "no cudarc NCCL sources in ~/.cargo/registry: no libnccl stub (only --features nccl needs it)"
    else
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        grep -rohE '\bfn[[:space:]]+nccl[A-Za-z0-9_]*[[:space:]]*[(<]' "${nccl_srcs[@]}" |
            sed -E 's/^fn[[:space:]]+//; s/[[:space:]]*[(<]$//' | sort -u >"$work/symbols"
        n=$(wc -l <"$work/symbols")
        ((n > 10)) || die "only $n NCCL symbols found in ${nccl_srcs[*]}"
        sed -E 's/.*/void &(void) {}/' "$work/symbols" >"$work/stub.c"
        mkdir -p "$lib/stubs"
        gcc -shared -fPIC -O0 -Wl,-soname,libnccl.so.2 -o "$work/libnccl.so" "$work/stub.c" ||
            die "building the libnccl stub failed"
        mv -f "$work/libnccl.so" "$nccl_stub"
        rm -rf "$work"
        trap - EXIT
        log "built $nccl_stub with $n dummy entry points"
    fi
fi

"$ROOT/bin/nvcc" --version >/dev/null 2>&1 || die "$ROOT/bin/nvcc does not run"
log "ready: $("$ROOT/bin/nvcc" --version | grep -o 'release [0-9.]*'), cuobjdump $([[ -x $ROOT/bin/cuobjdump ]] && echo yes || echo no)"

printf 'export CUDA_HOME=%q\n' "$ROOT"
printf 'export PATH=%q:$PATH\n' "$ROOT/bin"
printf 'export CUDA_COMPUTE_CAP=90\n'
