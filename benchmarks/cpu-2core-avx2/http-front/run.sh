#!/usr/bin/env bash
# The HTTP front against the hand-written one it replaced, side by side on this machine: each serves deploy/config.yaml
# in turn (--no-ray), probed by benchmarks/http_front.py; throughput passes alternate old, new, old, new.
#   OLD=<commit with the old front> bash benchmarks/cpu-2core-avx2/http-front/run.sh > results.jsonl
set -euo pipefail
cd "$(dirname "$0")/../../.."
OLD=${OLD:?the commit of the old front}
rm -rf /tmp/front-old /tmp/front-oldpkg && git worktree add -f /tmp/front-old "$OLD" -q
mkdir -p /tmp/front-oldpkg/blockspec
for d in common protos services; do ln -sfn /tmp/front-old/$d /tmp/front-oldpkg/blockspec/$d; done
serve() {  # $1: old or new; runs the probe with the rest of the arguments against it
  local which=$1; shift
  local dir=. path=
  if [ "$which" = old ]; then dir=/tmp/front-old; path=/tmp/front-oldpkg; fi
  (cd "$dir"; PYTHONPATH=$path setsid "$OLDPWD/.venv/bin/python" -m blockspec.services.cli serve \
     --config deploy/config.yaml --no-ray >/tmp/front-serve.log 2>&1 & echo $! >/tmp/front-serve.pid)
  until grep -q SERVING /tmp/front-serve.log; do sleep 1; done
  echo "{\"front\": \"$which\", \"result\": $(.venv/bin/python benchmarks/http_front.py --http 127.0.0.1:8000 "$@")}" \
    | .venv/bin/python -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))'
  kill -TERM -- -"$(cat /tmp/front-serve.pid)"; sleep 5
}
for which in old new; do serve $which --skip-throughput; done
for which in old new old new; do serve $which --skip-probes --requests 16 --max-tokens 64; done
git worktree remove --force /tmp/front-old
