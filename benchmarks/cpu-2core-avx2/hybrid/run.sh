#!/usr/bin/env bash
# A small Qwen3.5-shaped hybrid target trained briefly (train_target.py), a DFlash-2 drafter distilled from it briefly,
# and `blockspec bench` of plain decoding, n-gram and dflash on it. From the repository root:
#   bash benchmarks/cpu-2core-avx2/hybrid/run.sh WORK_DIR OUT_DIR
set -euo pipefail
WORK=${1:?work dir}; OUT=${2:?out dir}
BIN=${BIN:-.venv/bin}
HERE=$(dirname "$0")
mkdir -p "$WORK" "$OUT"
"$BIN/python" "$HERE/train_target.py" "$WORK/target"
STDLIB=$("$BIN/python" -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
"$BIN/blockspec" train-drafter --target "$WORK/target" --out "$WORK/drafter" --text-file "$STDLIB/json" \
  "$STDLIB/email" --prompts 512 --steps 600
"$BIN/blockspec" bench --target "$WORK/target" --drafter "$WORK/drafter" --modes none,ngram:5,dflash:5,dflash:7 \
  --concurrency 1,8 --rounds 3 --threads 2 --out "$OUT"
