#!/usr/bin/env bash
# One command on a GPU machine (< 8 minutes on one H200): random-weight Qwen3-shaped targets of about
# 1B, 8B and 27B parameters (bf16) with matching DFlash drafters -> r(k+1), c_d, step-loop overhead,
# CUDA IPC sharing between two processes, bf16 verify-vs-decode exactness (default and invariant).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
exec .venv/bin/blockspec gpu-check --device cuda --sizes "${SIZES:-1b,8b,27b}" --out "${OUT:-gpu-check-out}"
