#!/usr/bin/env bash
# Baseline: karpathy/llm.c's hand-written CUDA GPT-2 trainer (train_gpt2.cu), commit
# f1e2ace651495b74ae22d45d1723443fd00ecd3a (2025-05-10, "Merge pull request #801"), timed on the
# GPU machine next to our trainer's shapes. Runs ON the GPU machine, from the repo root:
#
#   run  carry [".device-exp"]  command "bash scripts/llmc_baseline.sh"
#
# What it does:
#   1. decompresses .device-exp/llmc/train_gpt2cu.xz ($LLMC_BIN: another .xz, or a plain binary)
#      into a temporary folder;
#   2. puts the nvidia/*/lib folders of python3's site-packages (PyTorch's CUDA wheels: cuBLASLt)
#      in front of LD_LIBRARY_PATH; the system's ldconfig paths stay as a fallback;
#   3. writes llm.c token files (header: 256 int32, [0]=20240520 magic, [1]=1 version, [2]=token
#      count; then uint16 tokens): train (TRAIN_TOKENS, default 24M) and val (VAL_TOKENS, default
#      1M) from the bytes of the Python standard library's .py files, one token per byte (ids <
#      256, valid GPT-2 ids). Val comes from files disjoint from train's;
#   4. trains GPT-2 124M from random init (llm.c descriptor `-e d12`: 12 layers, 768 channels,
#      12 heads, max_seq_len 1024, vocab 50257 padded to 50304), bf16, micro-batch B x T = 16 x 1024
#      tokens, total batch 65536 tokens (-d), i.e. 4 gradient-accumulation micro-batches per step,
#      STEPS (default 30) optimizer steps, AdamW lr 6e-4 (warmup 5, cosine to 0.1x), one val batch
#      at the first and last step only, no sampling, no checkpoints, no HellaSwag, ZeRO 0,
#      recompute 1 (llm.c's default: GELU recomputed in backward), gelu fusion 0 (train_gpt2.cu's
#      actual default, whatever its usage text says; pass LLMC_ARGS="-ge 2" for the cuBLASLt GELU
#      epilogue). LLMC_ARGS is appended to the command line (later flags override earlier ones);
#   5. parses llm.c's step lines
#        step    5/30 | loss 7.1 (+1.2z)| norm 1.2 (+0.3z)| lr 3.0e-04 | 123.45 ms | 45.6% bf16 MFU | 531000 tok/s
#      and prints one JSON line last. tokens_per_s is the median over steps after the first SKIP
#      (default 5) of B*T*accum / step time (the step's cudaEvent time: forward, backward,
#      grad-norm and AdamW; not the data loading between steps). llm.c's own tok/s column is an
#      EMA (tokens_per_s_llmc_ema_last). mfu_percent_llmc is the median of llm.c's own MFU column:
#      its FLOP count is 6*N + 6*L*C*T per token (N = all 124.475M parameters including wte/wpe,
#      attention counted unmasked), divided by its table's peak: "NVIDIA H100 80GB HBM3" -> 756
#      TFLOPS * 528/456 SMs * 1830/1620 MHz = 989 TFLOPS dense bf16; "NVIDIA H100 PCIe" -> 756;
#      any GPU not in its table (an H200, "NVIDIA H200") prints -100% (the JSON gives null there).
#      flops_per_token_llmc is given so the figure can be recomputed against another peak.
#   Full log: $OUT/llmc.log ($OUT is the device tool's output folder, else /tmp/llmc-baseline).
#   Env: STEPS, B, T, TOTAL (tokens per step), SKIP, TRAIN_TOKENS, VAL_TOKENS, LLMC_ARGS, LLMC_BIN.
#   `bash scripts/llmc_baseline.sh --data-only DIR` only writes DIR/train_000.bin, DIR/val_000.bin.
#
# This build has no cuDNN (attention is llm.c's own kernels: cuBLASLt matmuls for QK^T and AV with
# the full T x T scores materialised and a softmax kernel, not flash attention), no NCCL, no MPI,
# no NVML (nvml.h absent at build time: mfu.h's USE_NVML=0; `-lg` GPU-info logging is a no-op).
# llm.c's headline H100 numbers use USE_CUDNN=1 (cuDNN flash attention), so this is its plain
# build. Step time includes llm.c's per-step cudaEventSynchronize + host work (it is not overlapped).
#
# How the binary was packed (development machine, no GPU, CUDA 13.0 toolkit from PyPI; a later
# session can repeat this):
#   fetch github:karpathy/llm.c -> git --git-dir=<mirror> archive f1e2ace6 | tar -x -C /tmp/llmc
#   pip install --target /tmp/nvtx "nvidia-nvtx==13.0.*"                        # nvtx3/ headers (header-only)
#   pip install --target /tmp/cudaprof "nvidia-cuda-profiler-api==13.0.*"       # cuda_profiler_api.h
#   # CUDA 13 dropped cudaMemAdvise(..., int device): llmc/cuda_utils.cuh line 220 (the managed-memory
#   # OOM fallback, not hit at these sizes) patched to
#   #   cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})
#   cd /tmp/llmc && eval "$(/work/main/scripts/install-cuda-toolkit.sh ~/.cache/flash-attn3/cuda 2>/dev/null)" &&
#   nvcc --threads=0 -t=0 --use_fast_math -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -DENABLE_BF16 \
#     -I/tmp/nvtx/nvidia/cu13/include -I/tmp/cudaprof/nvidia/cu13/include \
#     train_gpt2.cu -L"$CUDA_HOME/lib" -lcublas -lcublasLt -o train_gpt2cu
#   strip train_gpt2cu && xz -T2 -9 -c train_gpt2cu > .device-exp/llmc/train_gpt2cu.xz
# (nvcc 13.0.88; 12 s; stripped 1,049,968 bytes, sha256 7e577f0d..., .xz 230,724 bytes; cudart
# linked statically; NEEDED: libcublasLt.so.13 only, besides libstdc++/libm/libgcc_s/libc; needs
# GLIBC 2.34. The flags are llm.c's Makefile's NVCC_FLAGS with PRECISION=BF16, NO_MULTI_GPU,
# NO_USE_MPI, USE_CUDNN=0 and GPU_COMPUTE_CAPABILITY=90 (it uses code=[compute_90,sm_90]; no PTX here).)
set -uo pipefail

LLMC_COMMIT=f1e2ace651495b74ae22d45d1723443fd00ecd3a

write_data() { # write_data DIR TRAIN_TOKENS VAL_TOKENS
    python3 - "$@" <<'PY'
import glob, os, struct, sys
out, n_train, n_val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out, exist_ok=True)
src = os.path.dirname(os.__file__)
files = sorted(glob.glob(os.path.join(src, "**", "*.py"), recursive=True))
if not files:
    sys.exit(f"no .py files under {src}")
# every 25th file goes to val, the rest to train (disjoint); cycle if the library is too small
val_files = files[::25]
train_files = [f for i, f in enumerate(files) if i % 25]
def collect(fs, n):
    buf = bytearray()
    while len(buf) < n:
        for f in fs:
            with open(f, "rb") as fh:
                buf += fh.read()
            if len(buf) >= n:
                break
    return bytes(buf[:n])
for name, fs, n in (("train_000.bin", train_files, n_train), ("val_000.bin", val_files, n_val)):
    data = collect(fs, n)
    header = struct.pack("<256i", 20240520, 1, n, *([0] * 253))
    toks = bytearray(2 * n)  # little-endian uint16 ids: low byte = the byte value, high byte 0
    toks[0::2] = data
    with open(os.path.join(out, name), "wb") as fh:
        fh.write(header)
        fh.write(toks)
    print(f"{name}: {n} tokens from {src} ({len(fs)} files)", file=sys.stderr)
PY
}

if [[ ${1:-} == --data-only ]]; then
    write_data "${2:?usage: $0 --data-only DIR}" "${TRAIN_TOKENS:-24000000}" "${VAL_TOKENS:-1000000}"
    exit
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/llmc-baseline}
mkdir -p "$OUT"
STEPS=${STEPS:-30}
B=${B:-16}
T=${T:-1024}
TOTAL=${TOTAL:-65536}
SKIP=${SKIP:-5}
log() { printf '[llmc-baseline %s] %s\n' "$(date +%T)" "$*" | tee -a "$OUT/progress.txt" >&2; }

# 1. The binary.
LLMC_BIN=${LLMC_BIN:-.device-exp/llmc/train_gpt2cu.xz}
[[ -f $LLMC_BIN ]] || { log "no $LLMC_BIN: pack it (see this script's header) and carry .device-exp"; exit 1; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [[ $LLMC_BIN == *.xz ]]; then
    if command -v xz >/dev/null; then
        xz -d -c "$LLMC_BIN" >"$WORK/train_gpt2cu"
    else
        python3 -c "import lzma,shutil,sys;shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" "$LLMC_BIN" "$WORK/train_gpt2cu"
    fi
else
    cp "$LLMC_BIN" "$WORK/train_gpt2cu"
fi
chmod +x "$WORK/train_gpt2cu" || exit 1

# 2. cuBLASLt from PyTorch's nvidia wheels (nvidia/cu13/lib for cu130 wheels, nvidia/cublas/lib
# for cu12x ones); the system's ldconfig paths (/usr/local/cuda/...) remain behind them.
wheel_libs=$(python3 - <<'PY'
import glob, site
dirs = []
for d in site.getsitepackages() + glob.glob("/opt/torch/.venv/lib/python3*/site-packages"):
    for lib in sorted(glob.glob(f"{d}/nvidia/*/lib")):
        if lib not in dirs:
            dirs.append(lib)
print(":".join(dirs))
PY
)
[[ -n $wheel_libs ]] && export LD_LIBRARY_PATH=$wheel_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
ldd "$WORK/train_gpt2cu" >"$OUT/ldd.txt" 2>&1
log "cuBLASLt: $(grep -o 'libcublasLt[^ ]* => [^ ]*' "$OUT/ldd.txt" || echo '?')"
if grep -q 'not found' "$OUT/ldd.txt"; then
    log "missing shared libraries:"; grep 'not found' "$OUT/ldd.txt" >&2; exit 1
fi
nvidia-smi -L 2>/dev/null | head -n1 | tee "$OUT/gpu.txt" >&2

# 3. Data.
write_data "$WORK/data" "${TRAIN_TOKENS:-24000000}" "${VAL_TOKENS:-1000000}" || exit 1

# 4. Train. gpt2_tokenizer.bin / HellaSwag files are absent (cwd = $WORK): llm.c warns and goes on.
read -r -a extra <<<"${LLMC_ARGS:-}"
args=(-i "$WORK/data/train_*.bin" -j "$WORK/data/val_*.bin" -o "$WORK/log" -e d12
      -b "$B" -t "$T" -d "$TOTAL" -x "$STEPS" -l 6e-4 -u 5 -q 0.1 -c 0.1
      -v 1000000 -m 1 -s 0 -n 0 -y 0 -h 0 -z 0 -r 1 "${extra[@]}")
log "train_gpt2cu ${args[*]}"
(cd "$WORK" && timeout "${LLMC_TIMEOUT:-540}" ./train_gpt2cu "${args[@]}") >"$OUT/llmc.log" 2>&1
rc=$?
log "train_gpt2cu exit $rc; last lines:"
tail -n 4 "$OUT/llmc.log" >&2

# 5. Summary.
python3 - "$OUT/llmc.log" "$LLMC_COMMIT" "$B" "$T" "$TOTAL" "$SKIP" "$rc" <<'PY'
import json, re, statistics, sys
path, commit, B, T, total, skip, rc = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
text = open(path, errors="replace").read()
step_re = re.compile(r"step\s+(\d+)/(\d+) \| loss (\S+) \(.*?\)\| norm (\S+) \(.*?\)\| lr (\S+) \| "
                     r"([\d.]+) ms \| (-?[\d.]+)% bf16 MFU \| (\d+) tok/s")
steps = [m.groups() for m in step_re.finditer(text)]
def grab(pat, cast=str):
    m = re.search(pat, text)
    return cast(m.group(1).strip()) if m else None
params = grab(r"num_parameters: (\d+)", int)
L = grab(r"\| num_layers L\s*\| (\d+)", int)
C = grab(r"\| channels C\s*\| (\d+)", int)
accum = grab(r"grad_accum_steps=(\d+)", int) or total // (B * T)
timed = steps[skip:] if len(steps) > skip else steps[1:]
ms = [float(s[5]) for s in timed]
mfu = [float(s[6]) for s in timed]
res = {
    "impl": f"llm.c train_gpt2cu (commit {commit[:12]}, bf16, no cuDNN)",
    "commit": commit,
    "device": grab(r"\| device\s*\| (.*?)\|"),
    "exit_code": rc,
    "steps_parsed": len(steps),
    "steps_timed": len(ms),
    "tokens_per_s": round(B * T * accum / (statistics.median(ms) / 1000)) if ms else None,
    "step_ms_median": round(statistics.median(ms), 3) if ms else None,
    "step_ms_min": min(ms) if ms else None,
    "mfu_percent_llmc": (statistics.median(mfu) if mfu and statistics.median(mfu) >= 0 else None),
    "peak_tflops_llmc": grab(r"\| peak TFlops\s*\| (-?[\d.]+)", float),
    "flops_per_token_llmc": (6 * params + 6 * L * C * T) if params and L and C else None,
    "tokens_per_s_llmc_ema_last": int(steps[-1][7]) if steps else None,
    "params": params,
    "seq_len": T,
    "batch": B,
    "grad_accum": accum,
    "first_loss": float(steps[0][2]) if steps else None,
    "last_loss": float(steps[-1][2]) if steps else None,
}
print(json.dumps(res))
PY
exit "$rc"
