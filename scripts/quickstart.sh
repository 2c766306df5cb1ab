#!/usr/bin/env bash
# Install specflash, serve the embedded default model pair, answer one request,
# then shut the server down. The first run converts the embedded target (once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
BIN="${VIRTUAL_ENV:-$PWD/.venv}/bin"
PORT="${SPECFLASH_PORT:-8000}"
LOG="$(mktemp -t specflash-serve.XXXXXX.log)"
"$BIN/specflash" serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "waiting for specflash serve on :$PORT (log: $LOG)"
for _ in $(seq 1 300); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then cat "$LOG"; echo "server exited" >&2; exit 1; fi
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model": "specflash", "max_tokens": 64, "temperature": 0,
         "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}'
echo
