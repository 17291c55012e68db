#!/usr/bin/env bash
# The soak (benchmarks/soak.py) against earlier releases on this machine: each revision serves deploy/config.yaml in
# turn (--no-ray) from a worktree of its own; passes alternate over the revisions, ROUNDS times.
#   REVS="4607489 HEAD" SECONDS_PER_PASS=120 ROUNDS=2 bash benchmarks/cpu-2core-avx2/soak/run.sh > results.jsonl
set -euo pipefail
cd "$(dirname "$0")/../../.."
REVS=${REVS:?the revisions to compare, e.g. "4607489 HEAD"}
ROOT=$PWD
for rev in $REVS; do
  dir=/tmp/soak-$rev
  rm -rf "$dir" "$dir-pkg" && git worktree add -f --detach "$dir" "$rev" -q
  mkdir -p "$dir-pkg" && ln -sfn "$dir" "$dir-pkg/blockspec"  # `blockspec` imports from the worktree
done
serve_and_soak() {  # $1: the revision
  local dir=/tmp/soak-$1
  (cd "$dir"; PYTHONPATH=$dir-pkg setsid "$ROOT/.venv/bin/python" -m blockspec.services.cli serve \
     --config deploy/config.yaml --no-ray >/tmp/soak-serve.log 2>&1 & echo $! >/tmp/soak-serve.pid)
  until grep -q SERVING /tmp/soak-serve.log; do sleep 1; done
  local result
  result=$(PYTHONPATH=$dir-pkg "$ROOT/.venv/bin/python" benchmarks/soak.py --streams "${STREAMS:-64}" \
           --seconds "${SECONDS_PER_PASS:-120}")
  echo "{\"rev\": \"$1\", \"commit\": \"$(git rev-parse --short "$1")\", \"result\": $result}"
  kill -TERM -- -"$(cat /tmp/soak-serve.pid)"; sleep 3
}
for _ in $(seq "${ROUNDS:-2}"); do
  for rev in $REVS; do serve_and_soak "$rev"; done
done
for rev in $REVS; do git worktree remove --force "/tmp/soak-$rev"; rm -rf "/tmp/soak-$rev-pkg"; done
