#!/usr/bin/env bash
# The main job on the shipped default pair: serve it (router + verifier + drafter processes), stream
# a completion through the gRPC API, print tau / acceptance / speed; then the same prompt with plain
# decoding in-process for comparison. Run from the repository root after `make setup`.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PAIR=${PAIR:-models/base}
# Default: the first held-out prompt (a file the pair never trained on).
PROMPT=${PROMPT:-$("$BIN/python" -c "import json; print(json.loads(open('$PAIR/heldout_prompts.jsonl').readline()))")}
LOG=$(mktemp)
# The C++ CPU kernels are compiled on first use (about a minute here, then cached): a one-token run builds
# them now, so the roles below start in seconds instead of each compiling while the demo waits.
echo "== loading the CPU kernels (the first run on a machine compiles them: about a minute)"
"$BIN/blockspec" generate "x" --target "$PAIR/target" --drafter "$PAIR/drafter" --max-tokens 1 --json >/dev/null
"$BIN/blockspec" serve --config deploy/config.yaml --no-ray --port 0 --grpc-port 0 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do  # up to 5 minutes
  grep -q '^SERVING' "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
grep -q '^SERVING' "$LOG" || { echo "the server did not start in 5 minutes:"; cat "$LOG"; exit 1; }
GRPC=$(sed -n 's/^SERVING grpc=\([0-9]*\).*/\1/p' "$LOG")
HTTP=$(sed -n 's/^SERVING .*http=\([0-9]*\)/\1/p' "$LOG")
echo "== blockspec serving on gRPC :$GRPC, HTTP :$HTTP (health: $(curl -s -o /dev/null -w '%{http_code}' localhost:$HTTP/health))"
echo "== speculative (dflash, k=5), streamed from the server:"
"$BIN/blockspec" generate "$PROMPT" --server "localhost:$GRPC" --max-tokens 128
echo "== the same prompt in-process: speculative (dflash, k=5, with prompt lookup as served, then without), then plain decoding (the baseline):"
"$BIN/blockspec" generate "$PROMPT" --target "$PAIR/target" --drafter "$PAIR/drafter" -k 5 --prompt-lookup --max-tokens 128 | tail -n 1
"$BIN/blockspec" generate "$PROMPT" --target "$PAIR/target" --drafter "$PAIR/drafter" -k 5 --max-tokens 128 | tail -n 1
"$BIN/blockspec" generate "$PROMPT" --target "$PAIR/target" --method none --max-tokens 128 | tail -n 1
echo "(the small target loops under greedy decoding; see README, 'The default pair')"
