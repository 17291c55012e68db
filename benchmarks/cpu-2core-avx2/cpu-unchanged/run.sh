#!/usr/bin/env bash
# Paired runs of the shipped pair, alternating two checkouts: BASE (a worktree of REV, default 12861d5, the engine
# before the CUDA backend) and this one. Usage: bash run.sh OUT_DIR
set -euo pipefail
MAIN=$(cd "$(dirname "$0")/../../.." && pwd)
BASE=${BASE:-/tmp/ab/base}
REV=${REV:-12861d5}
OUT=${1:?usage: run.sh OUT_DIR}
mkdir -p "$OUT"
if [ ! -d "$BASE" ]; then git -C "$MAIN" worktree add -f "$BASE" "$REV" >/dev/null; fi
shim=$(mktemp -d); mkdir -p "$shim/blockspec"  # BASE as the package, beside this checkout's .venv
for part in common protos services; do ln -s "$BASE/$part" "$shim/blockspec/$part"; done
ARGS="--modes none,dflash:5,dflash:7:lookup --concurrency 1,8 --rounds 3"
for i in 1 2; do
  (cd "$BASE" && PYTHONPATH="$shim" "$MAIN/.venv/bin/python" -m blockspec.services.cli.main bench --target "$MAIN/models/base/target" --drafter "$MAIN/models/base/drafter" $ARGS --out "$OUT/base-$i") > "$OUT/base-$i.log" 2>&1
  (cd "$MAIN" && "$MAIN/.venv/bin/python" -m blockspec.services.cli.main bench $ARGS --out "$OUT/main-$i") > "$OUT/main-$i.log" 2>&1
done
