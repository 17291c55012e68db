#!/usr/bin/env bash
# The main job on the shipped default pair: serve it (router + verifier + drafter processes), stream
# a completion through the gRPC API, print tau / acceptance / speed; then the same prompt with plain
# decoding in-process for comparison. Run from the repository root after `make setup`.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PAIR=${PAIR:-models/base}
PROMPT=${PROMPT:-$'def parse_args(argv=None):\n    """Parse the command line."""\n'}
LOG=$(mktemp)
"$BIN/blockspec" serve --config deploy/config.yaml --no-ray --port 0 --grpc-port 0 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 120); do
  grep -q '^SERVING' "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
GRPC=$(sed -n 's/^SERVING grpc=\([0-9]*\).*/\1/p' "$LOG")
HTTP=$(sed -n 's/^SERVING .*http=\([0-9]*\)/\1/p' "$LOG")
echo "== blockspec serving on gRPC :$GRPC, HTTP :$HTTP (health: $(curl -s -o /dev/null -w '%{http_code}' localhost:$HTTP/health))"
echo "== speculative (dflash, k=5), streamed from the server:"
"$BIN/blockspec" generate "$PROMPT" --server "localhost:$GRPC" --max-tokens 128
echo "== the same prompt, plain decoding in-process (the baseline):"
"$BIN/blockspec" generate "$PROMPT" --target "$PAIR/target" --method none --max-tokens 128 | tail -n 1
