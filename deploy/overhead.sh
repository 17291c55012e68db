#!/usr/bin/env bash
# Serving overhead at concurrency 1: the same held-out prompts through the in-process engine, through
# `serve --inprocess` (the engine in the server process: the API's gRPC only), `serve --no-ray` (role processes +
# gRPC) and `serve` on Ray (actors + gRPC).
# Prints aggregate tokens/s (all generated tokens / all request times) and the ratios.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PAIR=${PAIR:-models/base}
PROMPTS=${PROMPTS:-$PAIR/heldout_prompts.jsonl}
N=${N:-128}
CONFIG=${CONFIG:-deploy/config.yaml}  # the served runs' config (model paths relative to the repository root)
# tokens / wall time. In-process all requests are submitted at once and run one at a time, so the wall
# time is the last request's elapsed (it includes the queueing); through the server the client sends
# them one after the other, so it is the sum.
agg() { python3 -c 'import json,sys; r=[json.loads(l) for l in sys.stdin if l.startswith("{")]; t=sum(len(x["token_ids"]) for x in r); e=[x["stats"]["elapsed_s"] for x in r]; w=max(e) if sys.argv[1]=="max" else sum(e); print(round(t/w, 1))' "$1"; }
served() {  # $1: extra serve flags
  local log; log=$(mktemp)
  "$BIN/blockspec" serve --config "$CONFIG" $1 --port 0 --grpc-port 0 >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do grep -q '^SERVING' "$log" && break; sleep 0.5; done
  local port; port=$(sed -n 's/^SERVING grpc=\([0-9]*\).*/\1/p' "$log")
  "$BIN/blockspec" generate --server "localhost:$port" --prompts-file "$PROMPTS" --max-batch 1 --max-tokens "$N" --json | agg sum
  kill "$pid"; wait "$pid" 2>/dev/null || true; rm -f "$log"
}
# As deploy/config.yaml serves: dflash, k=5, prompt lookup first.
inproc=$("$BIN/blockspec" generate --target "$PAIR/target" --drafter "$PAIR/drafter" --prompts-file "$PROMPTS" \
         --max-batch 1 --max-tokens "$N" --prompt-lookup --json | agg max)
inserve=$(served --inprocess)
norai=$(served --no-ray)
onray=$(served "")
python3 - "$inproc" "$inserve" "$norai" "$onray" <<'PY'
import sys
a, i, b, c = map(float, sys.argv[1:])
print("| deployment (dflash with lookup, k=5, c=1) | tokens/s | vs in-process |")
print("|---|---|---|")
for name, v in (("in-process engine", a), ("serve --inprocess (one process, the API's gRPC)", i),
                ("serve --no-ray (processes + gRPC)", b), ("serve on Ray (actors + gRPC)", c)):
    print(f"| {name} | {v:.1f} | {v / a:.2f} |")
PY
