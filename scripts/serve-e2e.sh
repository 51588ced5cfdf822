#!/usr/bin/env bash
# End-to-end check of the `serve` example with the default model on the CPU, through curl: the
# routes answer, a chat completion streams text and ends with [DONE], a completion honours
# max_tokens and a stop string, bad requests get 4xx, and 4 concurrent streaming clients all get
# complete answers. Prints one line per check; exits non-zero on the first failure.
#
#   scripts/serve-e2e.sh [PORT]        (default 8093; fetches the model and builds first)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORT=${1:-8093}
URL=http://127.0.0.1:$PORT

scripts/fetch-default-model.sh >/dev/null
cargo build --release --example serve
LOG=$(mktemp)
target/release/examples/serve --cpu --port "$PORT" --name smollm2 >"$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$LOG"' EXIT
for _ in $(seq 1 120); do
    curl -sf "$URL/health" >/dev/null && break
    kill -0 $PID 2>/dev/null || { cat "$LOG"; echo "serve-e2e: the server exited" >&2; exit 1; }
    sleep 0.5
done

fail() { echo "serve-e2e: FAILED: $*" >&2; exit 1; }
check() { echo "ok: $*"; }

curl -sf "$URL/health" | grep -q '"ok"' || fail "/health"
check "/health"
curl -sf "$URL/v1/models" | grep -q '"id":"smollm2"' || fail "/v1/models"
check "/v1/models lists smollm2"

out=$(curl -sfN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0, "stream": true}')
[[ $(grep -c '^data: {' <<<"$out") -ge 3 ]] || fail "streamed chat: too few chunks: $out"
tail -n 2 <<<"$out" | grep -q '^data: \[DONE\]' || fail "streamed chat: no [DONE]: $out"
text=$(grep '^data: {' <<<"$out" | sed 's/^data: //' | python3 -c 'import json,sys; print("".join((json.loads(l)["choices"][0]["delta"].get("content") or "") for l in sys.stdin))')
grep -qi paris <<<"$text" || fail "streamed chat: no Paris in: $text"
check "streamed chat: $(tr '\n' ' ' <<<"$text")"

out=$(curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "One, two, three, four,", "max_tokens": 5, "temperature": 0}')
python3 -c 'import json,sys; v=json.loads(sys.argv[1]); u=v["usage"]; assert u["completion_tokens"]==5 and v["choices"][0]["finish_reason"]=="length", v' "$out" ||
    fail "completion max_tokens: $out"
check "completion, max_tokens 5: $(python3 -c 'import json,sys; print(repr(json.loads(sys.argv[1])["choices"][0]["text"]))' "$out")"
out=$(curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "One, two, three, four,", "max_tokens": 20, "temperature": 0, "stop": ["six"]}')
python3 -c 'import json,sys; c=json.loads(sys.argv[1])["choices"][0]; assert c["finish_reason"]=="stop" and "six" not in c["text"], c' "$out" ||
    fail "completion stop string: $out"
check "completion, stop \"six\": $(python3 -c 'import json,sys; print(repr(json.loads(sys.argv[1])["choices"][0]["text"]))' "$out")"

# Text held back as a possible start of a stop string still goes out when the answer ends.
out=$(curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 30, "temperature": 0, "stop": ["Paris.X"]}')
python3 -c 'import json,sys; c=json.loads(sys.argv[1])["choices"][0]; assert c["message"]["content"].rstrip().endswith("Paris."), c' "$out" ||
    fail "held-back text lost at the end: $out"
check "held-back text kept at the end of an answer"

code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/completions" -d '{"prompt": ')
[[ $code == 400 ]] || fail "malformed JSON gave $code"
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/completions" -d '{"model": "other", "prompt": "x"}')
[[ $code == 404 ]] || fail "unknown model gave $code"
check "malformed JSON 400, unknown model 404"

pids=()
for i in 1 2 3 4; do
    curl -sfN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"messages\": [{\"role\": \"user\", \"content\": \"Count to $i.\"}], \"max_tokens\": 12, \"stream\": true, \"seed\": $i}" \
        >"$LOG.$i" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || fail "a concurrent client failed"; done
for i in 1 2 3 4; do
    tail -n 2 "$LOG.$i" | grep -q '^data: \[DONE\]' || fail "concurrent client $i: incomplete answer"
    rm -f "$LOG.$i"
done
check "4 concurrent streaming clients, every answer complete"
kill -0 $PID || fail "the server died"
echo "serve-e2e: all checks passed"
