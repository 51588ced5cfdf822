#!/usr/bin/env bash
# Runs on a GPU machine with several GPUs (device kinds nvidia-h100-x2/-x4/-x8, nvidia-h200-x*):
# data-parallel training of the train example's 125m preset through NCCL on 1, 2, 4, ... GPUs,
# checked against one GPU (the same global batch, so the same losses within bf16 noise) and timed
# next to PyTorch DDP (scripts/train_baseline.py under torchrun) in the same call. Short table last.
#
#   scripts/gpu-pack.sh --multi                      # here: .device/train-nccl.xz
#   run  kind nvidia-h100-x4  carry [".device"]  command "bash scripts/gpu-multi.sh"
#
# Env: GPUS (counts to run, default "1 2 4 8" up to the GPUs present), STEPS (timed optimizer
# steps, default 20), ACCUM (micro-batches of 8 x 2048 tokens per step, shared out over the GPUs;
# default 4, raised to the GPU count where smaller), SKIP=ddp,tp,dp,cp,cptrain (no PyTorch runs,
# no tensor-parallel generation, no data-parallel training, no ring attention, no
# context-parallel training), TP_SHAPES (default 1b,8b), CP_SEQS (ring attention's
# whole-sequence lengths, default "16384 65536"), CP_TRAIN_LENS (context-parallel training's
# long sequence lengths, default "131072 262144"), CP_TRAIN_STEPS (their steps, default 3),
# SKIP=cpeq (no equality runs at 16k). A baseline train build packed by hand as
# .device/train-nccl-base.xz runs alternating with this one (the table's "base" columns).
# Results and logs go to $OUT (the device tool's output folder) or /tmp/gpu-multi.
set -uo pipefail

# NVLink multicast stays off on these machines (the device tool's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu-multi}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
ACCUM=${ACCUM:-4}
SKIP=${SKIP:-}
log() { printf '[gpu-multi %s] %s\n' "$(date +%T)" "$*" | tee -a "$OUT/progress.txt" >&2; }

ngpus=$(nvidia-smi -L | grep -c '^GPU')
nvidia-smi -L | tee "$OUT/gpus.txt"
nvidia-smi topo -m >"$OUT/topology.txt" 2>&1 || true
GPUS=${GPUS:-1 2 4 8}
counts=()
for n in $GPUS; do ((n <= ngpus)) && counts+=("$n"); done
log "GPUs present: $ngpus; runs on: ${counts[*]}"

# The real libnccl.so.2: PyTorch's nvidia-nccl wheel (the build linked a stub of it).
source scripts/nccl-lib.sh || { log "no libnccl.so.2 in python3's site-packages"; exit 1; }
log "libnccl: $NCCL_LIB"

[[ -f .device/train-nccl.xz ]] || { log "no .device/train-nccl.xz: run scripts/gpu-pack.sh --multi and carry .device"; exit 1; }
BIN=$(mktemp -d)
xz -d -c .device/train-nccl.xz >"$BIN/train" && chmod +x "$BIN/train"

# The training ops' GPU tests first (the optimizer kernel among them), when packed.
if [[ -f .device/train-gpu-test.xz ]]; then
    xz -d -c .device/train-gpu-test.xz >"$BIN/train-gpu-test" && chmod +x "$BIN/train-gpu-test"
    timeout 120 "$BIN/train-gpu-test" --test-threads=1 >"$OUT/train-gpu-test.log" 2>&1
    log "train GPU tests (exit $?): $(grep -E '^test result' "$OUT/train-gpu-test.log" | tail -n1)"
    grep -E 'FAILED|panicked' "$OUT/train-gpu-test.log" | head -n5 | tee -a "$OUT/progress.txt" >&2
fi

# A baseline build of the train example (.device/train-nccl-base.xz, packed by hand from an
# earlier commit) runs alternating with this one: an A/B in the same call. Or BASE_ARGS: the
# "base" runs are this build with these extra flags (BASE_ARGS=--autograd: candle's autograd
# against the explicit backward). ROUNDS (default 1) repeats each pair, alternating.
if [[ -f .device/train-nccl-base.xz ]]; then
    xz -d -c .device/train-nccl-base.xz >"$BIN/train-base" && chmod +x "$BIN/train-base"
elif [[ -n ${BASE_ARGS:-} ]]; then
    ln -s "$BIN/train" "$BIN/train-base"
fi
read -r -a base_args <<<"${BASE_ARGS:-}"
declare -A OURS DDP BASE
for n in "${counts[@]}"; do
    [[ ,$SKIP, == *,dp,* ]] && break
    accum=$((ACCUM < n ? n : ACCUM))
    accum=$(((accum + n - 1) / n * n))
    for round in $(seq "${ROUNDS:-1}"); do
    for build in ours base; do
        bin=$BIN/train
        extra=()
        if [[ $build == base ]]; then
            [[ -x $BIN/train-base ]] || continue
            bin=$BIN/train-base
            extra=("${base_args[@]}")
        fi
        log "$build (round $round): $n GPU(s), grad-accum $accum, $STEPS steps ${extra[*]}"
        timeout 240 "$bin" --preset 125m --data-parallel "$n" --grad-accum "$accum" --steps "$STEPS" \
            --eval-every "$STEPS" --sample 0 --out "$OUT/$build-$n" "${extra[@]}" >"$OUT/$build-$n.log" 2>&1
        rc=$?
        done_line=$(grep '^done:' "$OUT/$build-$n.log" | tail -n1)
        if ((rc != 0)) || [[ -z $done_line ]]; then
            log "$build on $n GPU(s) failed (exit $rc):"; tail -n5 "$OUT/$build-$n.log" | tee -a "$OUT/progress.txt" >&2
            continue
        fi
        tps=$(sed -E 's/.*: ([0-9]+) tokens\/s.*/\1/' <<<"$done_line")
        if [[ $build == ours ]]; then OURS[$n]=$tps; else BASE[$n]=$tps; fi
        log "$build $n (round $round): $tps tokens/s"
        rm -f "$OUT/base-$n/checkpoint.safetensors"
    done
    done
done

if [[ ,$SKIP, != *,ddp,* && ,$SKIP, != *,dp,* ]]; then
    for n in "${counts[@]}"; do
        accum=$((ACCUM < n ? n : ACCUM))
        accum=$(((accum + n - 1) / n * n))
        log "PyTorch DDP: $n GPU(s), grad-accum $accum"
        if ((n == 1)); then
            timeout 240 python3 scripts/train_baseline.py --grad-accum "$accum" --steps "$STEPS" >"$OUT/ddp-$n.json" 2>"$OUT/ddp-$n.log"
        else
            timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" scripts/train_baseline.py \
                --grad-accum "$accum" --steps "$STEPS" >"$OUT/ddp-$n.json" 2>"$OUT/ddp-$n.log"
        fi
        rc=$?
        DDP[$n]=$(python3 -c 'import json,sys; print(round(json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["tokens_per_s"]))' "$OUT/ddp-$n.json" 2>/dev/null)
        if ((rc != 0)) || [[ -z ${DDP[$n]} ]]; then
            log "DDP on $n GPU(s) failed (exit $rc):"; tail -n5 "$OUT/ddp-$n.log" | tee -a "$OUT/progress.txt" >&2
            DDP[$n]=
            continue
        fi
        log "DDP $n: ${DDP[$n]} tokens/s"
    done
fi

# Context-parallel (ring) attention through NCCL against one GPU's call, when packed.
if [[ ,$SKIP, != *,cp,* && -f .device/ring-attention.xz ]]; then
    xz -d -c .device/ring-attention.xz >"$BIN/ring-attention" && chmod +x "$BIN/ring-attention"
    for n in "${counts[@]}"; do
        ((n < 2)) && continue
        for seq in ${CP_SEQS:-16384 65536}; do
            timeout 120 "$BIN/ring-attention" --gpus "$n" --seq "$seq" >>"$OUT/cp.txt" 2>>"$OUT/cp.log"
            log "ring attention, $n GPUs, seq $seq: exit $?"
        done
    done
fi

# Context-parallel training (train --context-parallel N): the same losses as one GPU at a length
# that fits, then lengths where one GPU runs out of memory (batch 1, one micro-batch per step).
if [[ ,$SKIP, != *,cptrain,* ]] && ((ngpus >= 2)); then
    # A corpus whose held-out part is longer than the longest window.
    site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    cp_args=(--preset 125m --batch-size 1 --grad-accum 1 --eval-batches 1 --sample 0 --data "$site" --max-bytes 40000000)
    if [[ ,$SKIP, != *,cpeq,* ]]; then
        timeout 200 "$BIN/train" "${cp_args[@]}" --seq-len 16384 --steps 5 --eval-every 5 --out "$OUT/cpeq-1" >"$OUT/cpeq-1.log" 2>&1
        timeout 200 "$BIN/train" "${cp_args[@]}" --seq-len 16384 --steps 5 --eval-every 5 --context-parallel 2 --out "$OUT/cpeq-2" >"$OUT/cpeq-2.log" 2>&1
        log "context-parallel equality runs: $(grep -c '^done' "$OUT/cpeq-1.log" "$OUT/cpeq-2.log" | tr '\n' ' ')"
    fi
    for len in ${CP_TRAIN_LENS:-131072 262144}; do
        for n in 1 2; do
            extra=(); ((n > 1)) && extra=(--context-parallel "$n")
            steps=${CP_TRAIN_STEPS:-3}
            timeout 240 "$BIN/train" "${cp_args[@]}" --seq-len "$len" --steps "$steps" --eval-every "$steps" "${extra[@]}" \
                --out "$OUT/cplong-$n-$len" >"$OUT/cplong-$n-$len.log" 2>&1
            rc=$?
            done_line=$(grep '^done:' "$OUT/cplong-$n-$len.log" | tail -n1)
            if [[ -n $done_line ]]; then
                echo "seq $len on $n GPU(s): $(sed -E 's/.*: ([0-9]+ tokens\/s.*); checkpoint.*/\1/' <<<"$done_line")" >>"$OUT/cptrain.txt"
            else
                echo "seq $len on $n GPU(s): failed (exit $rc): $(grep -m1 -oiE 'out of memory|error[^\n]{0,160}' "$OUT/cplong-$n-$len.log" | head -n1)" >>"$OUT/cptrain.txt"
            fi
            log "$(tail -n1 "$OUT/cptrain.txt")"
            rm -f "$OUT/cplong-$n-$len/checkpoint.safetensors"
        done
    done
fi

# Tensor-parallel generation (generate --tp N) of random 1B- and 8B-shaped models, when packed.
if [[ ,$SKIP, != *,tp,* && -f .device/generate-nccl.xz ]]; then
    xz -d -c .device/generate-nccl.xz >"$BIN/generate" && chmod +x "$BIN/generate"
    tp_sizes=$(IFS=,; echo "${counts[*]}")
    log "tensor parallel: tp $tp_sizes, shapes ${TP_SHAPES:-1b,8b}"
    timeout "${TP_TIMEOUT:-300}" python3 scripts/gpu_tp.py --bin "$BIN/generate" --work "$BIN/tp" --tp "$tp_sizes" \
        --shapes "${TP_SHAPES:-1b,8b}" >"$OUT/tp.txt" 2>"$OUT/tp.log"
    log "tensor parallel done (exit $?)"
    rm -rf "$BIN/tp"
fi

# The same global batches: each count's per-step losses against one GPU's (from the checkpoints'
# histories; bf16 compute, so equal within rounding noise, not bit for bit).
python3 - "$OUT" "${counts[@]}" >"$OUT/losses.txt" <<'PY'
import json, sys
from safetensors import safe_open
out, counts = sys.argv[1], sys.argv[2:]
hist = {}
for n in counts:
    try:
        with safe_open(f"{out}/ours-{n}/checkpoint.safetensors", "np") as f:
            md = f.metadata()
            hist[n] = json.loads(md["history"])
            hist[n]["accum"] = json.loads(md["train_config"])["grad_accum"]
    except Exception as e:
        print(f"{n}: no history ({e})")
base = hist.get("1")
for n, h in hist.items():
    if n == "1" or base is None:
        continue
    if h["accum"] != base["accum"]:
        print(f"{n} GPUs: grad-accum {h['accum']} against {base['accum']} on one GPU: other batches, not compared")
        continue
    if len(h["train"]) != len(base["train"]):
        print(f"{n} GPUs: {len(h['train'])} steps against {len(base['train'])} on one GPU")
        continue
    rel = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(h["train"], base["train"])]
    ev = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(h["eval"], base["eval"])]
    print(f"{n} GPUs vs 1: train loss max rel diff {max(rel):.2e} over {len(rel)} steps "
          f"(first {h['train'][0][1]:.4f} vs {base['train'][0][1]:.4f}, last {h['train'][-1][1]:.4f} vs {base['train'][-1][1]:.4f}); "
          f"eval max rel diff {max(ev) if ev else float('nan'):.2e}")
PY
cat "$OUT/losses.txt"

{
    echo
    echo "== data-parallel 125m (8 x 2048-token micro-batches, global grad-accum max($ACCUM, N), $STEPS steps; tokens/s over all GPUs)"
    printf '%-5s %12s %9s %12s %9s %10s %12s %9s %10s\n' GPUs ours scaling DDP scaling ours/DDP base scaling ours/base
    for n in "${counts[@]}"; do
        o=${OURS[$n]:-} d=${DDP[$n]:-} b=${BASE[$n]:-}
        eff() { [[ -n $1 && -n $2 ]] && awk -v a="$1" -v b="$2" -v n="$n" 'BEGIN { printf "%.3f", a / (n * b) }' || echo -; }
        ratio() { [[ -n $1 && -n $2 ]] && awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }' || echo -; }
        printf '%-5s %12s %9s %12s %9s %10s %12s %9s %10s\n' "$n" "${o:--}" "$(eff "$o" "${OURS[1]:-}")" "${d:--}" \
            "$(eff "$d" "${DDP[1]:-}")" "$(ratio "$o" "$d")" "${b:--}" "$(eff "$b" "${BASE[1]:-}")" "$(ratio "$o" "$b")"
    done
} | tee "$OUT/table.txt"
[[ -f $OUT/tp.txt ]] && sed -n '/^== tensor-parallel/,$p' "$OUT/tp.txt" | tee -a "$OUT/table.txt"
[[ -f $OUT/cp.txt ]] && { echo "== context-parallel attention (ring, NCCL)"; cat "$OUT/cp.txt"; } | tee -a "$OUT/table.txt"
if [[ -f $OUT/cptrain.txt ]]; then
    {
        echo "== context-parallel training, 125m preset, batch 1"
        python3 - "$OUT" <<'PY'
import json, sys
from safetensors import safe_open
out = sys.argv[1]
h = {}
for n in ("1", "2"):
    try:
        with safe_open(f"{out}/cpeq-{n}/checkpoint.safetensors", "np") as f:
            h[n] = json.loads(f.metadata()["history"])
    except Exception as e:
        print(f"seq 16384 on {n} GPU(s): no history ({e})")
if len(h) == 2:
    rel = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(h["2"]["train"], h["1"]["train"])]
    ev = [abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(h["2"]["eval"], h["1"]["eval"])]
    print(f"seq 16384, 2 GPUs vs 1: train loss max rel diff {max(rel):.2e} over {len(rel)} steps, eval {max(ev):.2e}")
PY
        cat "$OUT/cptrain.txt"
    } | tee -a "$OUT/table.txt"
fi
