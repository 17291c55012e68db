#!/usr/bin/env bash
# generate's tokens/s with default threads and --threads 1: alone, beside a second generate in a loop, beside a busy
# Python loop. usage: run2.sh OUTFILE REPS
cd "$(dirname "$0")/../../.."
BIN=.venv/bin
OUT=${1:-/tmp/thr/out2.jsonl}; REPS=${2:-3}
PROMPT=$($BIN/python -c "import json; print(json.loads(open('models/base/heldout_prompts.jsonl').readline()))")
one() {  # label, args...
  local label=$1; shift
  local line
  line=$($BIN/blockspec generate "$PROMPT" --target models/base/target --max-tokens 256 --json "$@" 2>/dev/null | tail -n 1)
  echo "{\"label\": \"$label\", \"args\": \"$*\", \"load\": \"$LOAD\", \"result\": ${line:-null}}" >> "$OUT"
}
for LOAD in none generate spin; do
  case $LOAD in
    generate) ( while true; do $BIN/blockspec generate "$PROMPT" --target models/base/target --drafter models/base/drafter --max-tokens 1024 >/dev/null 2>&1; done ) & LOADER=$!; sleep 8 ;;
    spin) $BIN/python -c "while True: pass" & LOADER=$!; sleep 1 ;;
  esac
  for r in $(seq $REPS); do
    one default --drafter models/base/drafter
    one threads1 --drafter models/base/drafter --threads 1
    one default --method none
    one threads1 --method none --threads 1
  done
  if [ $LOAD != none ]; then kill $LOADER; pkill -f "max-tokens 1024"; wait $LOADER 2>/dev/null; fi
done
