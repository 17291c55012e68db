#!/usr/bin/env bash
# The main job on the shipped default pair (`make demo`): serve it as the operators' config does (router, verifier and
# drafter processes), stream a completion of a held-out prompt through the gRPC API, then measure speculative against
# plain decoding on all the held-out prompts in this process. Run from the repository root after `make setup`.
set -euo pipefail
BIN=${BIN:-.venv/bin}
PAIR=${PAIR:-models/base}
PROMPTS=${PROMPTS:-$PAIR/heldout_prompts.jsonl}  # files the pair never trained on, one JSON string a line
TOKENS=${TOKENS:-64}                             # the streamed completion
COMPARE_TOKENS=${COMPARE_TOKENS:-128}            # each prompt of the comparison
LOG=$(mktemp)
PROMPT_FILE=$LOG.prompt.jsonl  # the first held-out prompt, as a JSON line: its text ends with a newline, kept
if [ -n "${PROMPT:-}" ]; then
  "$BIN/python" -c "import json, sys; print(json.dumps(sys.argv[1]))" "$PROMPT" >"$PROMPT_FILE"
else
  head -n 1 "$PROMPTS" >"$PROMPT_FILE"
fi
SERVER=
trap '[ -n "$SERVER" ] && { kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; }; rm -f "$LOG" "$LOG".*' EXIT

"$BIN/python" - "$PAIR/card.json" <<'PY'
import json, sys
card = json.load(open(sys.argv[1]))
print(f"== blockspec demo: the default pair, a {card['target_parameters'] / 1e6:.1f}M-parameter target trained on "
      f"Python sources\n   and its {card['drafter_parameters'] / 1e6:.2f}M-parameter DFlash-2 drafter (a model "
      "this small writes Python-shaped text that soon repeats itself)")
PY
echo "== 1/4 loading the C++ CPU kernels (a new machine compiles them once, about a minute)"
"$BIN/blockspec" generate "x" --target "$PAIR/target" --drafter "$PAIR/drafter" --max-tokens 8 --json >/dev/null

echo "== 2/4 serving deploy/config.yaml: a router, a verifier and a drafter process"
"$BIN/blockspec" serve --config deploy/config.yaml --no-ray --port 0 --grpc-port 0 >"$LOG" 2>&1 &
SERVER=$!
for _ in $(seq 1 600); do  # up to 5 minutes
  grep -q '^SERVING' "$LOG" && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.5
done
grep -q '^SERVING' "$LOG" || { echo "the server did not start in 5 minutes:"; cat "$LOG"; exit 1; }
GRPC=$(sed -n 's/^SERVING grpc=\([0-9]*\).*/\1/p' "$LOG")
HTTP=$(sed -n 's/^SERVING .*http=\([0-9]*\)/\1/p' "$LOG")
echo "   gRPC on :$GRPC, HTTP on :$HTTP (GET /health: $(curl -s -o /dev/null -w '%{http_code}' "localhost:$HTTP/health"))"

echo "== 3/4 a held-out prompt:"
"$BIN/python" -c "import json, sys; print(json.loads(open(sys.argv[1]).readline()), end='')" "$PROMPT_FILE" \
  | sed 's/^/   | /'
echo "   its completion, streamed from the server (dflash k=5 with prompt lookup, greedy, $TOKENS tokens):"
"$BIN/blockspec" generate --prompts-file "$PROMPT_FILE" --server "localhost:$GRPC" --max-tokens "$TOKENS" \
  | sed 's/^/   | /'
kill $SERVER; wait $SERVER 2>/dev/null || true; SERVER=

echo "== 4/4 speculative against plain decoding in this process: the $(wc -l <"$PROMPTS") held-out prompts one at a" \
     "time, $COMPARE_TOKENS tokens each"
run() {  # label, generate flags: one JSON line per prompt into a file named after the label
  "$BIN/blockspec" generate --target "$PAIR/target" --prompts-file "$PROMPTS" --max-batch 1 \
    --max-tokens "$COMPARE_TOKENS" --json "${@:2}" >"$LOG.$1"
}
run lookup --drafter "$PAIR/drafter" -k 5 --prompt-lookup
run dflash --drafter "$PAIR/drafter" -k 5
run plain --method none
"$BIN/python" - "$LOG" <<'PY'
import json, sys
runs = {}
for name in ("lookup", "dflash", "plain"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}.{name}") if line.startswith("{")]
    tokens = sum(len(r["token_ids"]) for r in rows)
    wall = max(r["stats"]["elapsed_s"] for r in rows)  # submitted together, run one at a time: the last one's time
    steps = sum(r["stats"]["steps"] for r in rows)
    runs[name] = (tokens / wall, tokens / steps if steps else 0.0, [r["token_ids"] for r in rows])
plain_speed, _, plain_ids = runs["plain"]
labels = {"lookup": "speculative: dflash k=5 + prompt lookup", "dflash": "speculative: dflash k=5",
          "plain": "plain decoding (the target alone)"}
for name, (speed, tau, ids) in runs.items():
    same = "-" if name == "plain" else ("yes" if ids == plain_ids else "NO")
    print(f"   {labels[name]:<41} {speed:8.1f} tokens/s  {speed / plain_speed:4.2f}x  tokens per step {tau:4.2f}  "
          f"same tokens as plain decoding: {same}")
PY
