#!/usr/bin/env bash
# The `serve` example on the GPU machine with the default model (SmolLM2-135M-Instruct Q4_1, bf16),
# under scripts/serve-load.py's load test (32 streaming clients, 200 requests): requests/s,
# tokens/s, time to first token and inter-token latency. Runs ON the GPU machine, from the repo root.
#
# The binary: .device/serve.xz or .device-serve/serve.xz (scripts/gpu-pack.sh packs it). The model:
# models/SmolLM2-135M-Instruct.Q4_1.gguf, or its parts under .device-model/ (98 MB does not fit one
# device call's 64 MiB carry, so it travels in two calls to the same warm machine):
#
#   here:  scripts/gpu-serve-load.sh --split        (writes .device-model/part-00..02 and sha256,
#                                                    and .device-serve/serve.xz from .device/)
#   run 1: carry [".device-serve", ".device-model/part-00", ".device-model/sha256",
#                 ".device-model/gguf-0.19.0-py3-none-any.whl"]  command "true"
#   run 2: carry [".device-model/part-01", ".device-model/part-02"]  (within 30 s of run 1)
#          command "SLOTS=32 bash scripts/gpu-serve-load.sh"
#
# Env: SLOTS (default 32, comma-separated for several runs), REQUESTS (200), CLIENTS (32),
# SERVE_XZS (packed serve binaries to run in turn, e.g. this build's and an older one's),
# MAX_TOKENS (16), KV (model or fp8; default model), SERVE_ARGS (more flags for `serve`, e.g.
# "--page-size 16 --pages 256" for the paged KV cache). HF=1 then runs scripts/hf_serve_baseline.py
# (transformers' static batches of 32 on the same requests), installing the `gguf` wheel that
# --split put in .device-model/ (pip download gguf --no-deps). MODEL_SHAPE=1b serves, instead of the
# default model, random bf16 weights in the Llama-3.2-1B shape with the default model's tokenizer
# (scripts/serve_model_1b.py writes them to /tmp/serve-1b on the GPU machine, from the GGUF), and
# HF=1 runs transformers on the same directory.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf

if [[ ${1:-} == --split ]]; then
    [[ -f $MODEL ]] || { echo "no $MODEL: run scripts/fetch-default-model.sh" >&2; exit 1; }
    [[ -f .device/serve.xz ]] || { echo "no .device/serve.xz: run scripts/gpu-pack.sh" >&2; exit 1; }
    rm -rf .device-model .device-serve
    mkdir -p .device-model .device-serve
    split -b 49000000 -d -a 2 "$MODEL" .device-model/part-
    sha256sum "$MODEL" | cut -c1-64 >.device-model/sha256
    cp .device/serve.xz .device-serve/
    pip download gguf --no-deps -q -d .device-model/ || echo "no gguf wheel: HF=1 will not work" >&2
    du -sh .device-model/* .device-serve
    exit 0
fi

if [[ ! -f $MODEL ]]; then
    if [[ -f .device-model/part-00 && -f .device-model/part-01 ]]; then
        mkdir -p models
        cat .device-model/part-* >"$MODEL"
        [[ $(sha256sum "$MODEL" | cut -c1-64) == $(cat .device-model/sha256) ]] || { echo "gpu-serve-load: the joined model's sha256 differs" >&2; rm -f "$MODEL"; exit 1; }
    else
        echo "gpu-serve-load: no $MODEL and no parts under .device-model/ (a fresh machine between the two calls?)" >&2
        exit 1
    fi
fi
SERVED=$MODEL
if [[ ${MODEL_SHAPE:-default} == 1b ]]; then
    python3 -m pip install -q --no-index --no-deps .device-model/gguf-*.whl 2>&1 | grep -v WARNING | tail -1
    SERVED=/tmp/serve-1b
    [[ -f $SERVED/model.safetensors ]] || python3 scripts/serve_model_1b.py --gguf "$MODEL" --out "$SERVED" || exit 1
fi
# SERVE_XZS: several packed serve binaries (space-separated), run in turn for each slot count:
# an A/B of two builds in one call.
XZS=${SERVE_XZS:-}
if [[ -z $XZS ]]; then
    XZS=.device/serve.xz
    [[ -f $XZS ]] || XZS=.device-serve/serve.xz
fi
i=0
BINS=()
for xz in $XZS; do
    [[ -f $xz ]] || { echo "gpu-serve-load: no $xz (carry .device/ or .device-serve/)" >&2; exit 1; }
    xz -dc "$xz" >/tmp/serve-$i && chmod +x /tmp/serve-$i || exit 1
    BINS+=("/tmp/serve-$i:$xz")
    i=$((i + 1))
done

STATUS=0
for slots in ${SLOTS:-32}; do
    for s in ${slots//,/ }; do
        for entry in "${BINS[@]}"; do
            bin=${entry%%:*}
            # shellcheck disable=SC2086 # SERVE_ARGS is a word list
            "$bin" --model "$SERVED" --port 8095 --slots "$s" --kv-cache-dtype "${KV:-model}" ${SERVE_ARGS:-} >/tmp/serve.log 2>&1 &
            PID=$!
            for _ in $(seq 1 120); do
                curl -sf http://127.0.0.1:8095/health >/dev/null && break
                kill -0 $PID 2>/dev/null || break
                sleep 0.5
            done
            head -3 /tmp/serve.log
            echo "== $SERVED, slots $s, KV cache ${KV:-model} ${SERVE_ARGS:-}, ${entry#*:}"
            python3 scripts/serve-load.py --url http://127.0.0.1:8095 --clients "${CLIENTS:-32}" \
                --requests "${REQUESTS:-200}" --max-tokens "${MAX_TOKENS:-16}" || STATUS=1
            kill $PID 2>/dev/null
            wait $PID 2>/dev/null
        done
    done
done
if [[ ${HF:-0} == 1 ]]; then
    echo "== HF transformers"
    python3 -m pip install -q --no-index --no-deps .device-model/gguf-*.whl 2>&1 | grep -v WARNING | tail -1
    if [[ $SERVED == "$MODEL" ]]; then SOURCE=(--gguf "$MODEL"); else SOURCE=(--model-dir "$SERVED"); fi
    python3 scripts/hf_serve_baseline.py "${SOURCE[@]}" --requests "${REQUESTS:-200}" --batch "${CLIENTS:-32}" \
        --max-tokens "${MAX_TOKENS:-16}" || STATUS=1
fi
exit $STATUS
