#!/usr/bin/env bash
# One command on a GPU machine. First the smoke stage (at most 60 s; SMOKE=0 leaves it out): versions, copy
# bandwidth, whether cuBLAS is row-invariant for the 27B weights beside the Triton GEMM, and each batch-invariant
# operator at the 27B shapes (time and GB/s at 1 and 16 rows, row invariance, bf16 error against fp32). Then
# random-weight Qwen3-shaped targets of 0.75B, 8.2B and 26.7B parameters and a Qwen3.5-27B-shaped hybrid (26.9B; bf16)
# with matching DFlash drafters -> one table: the runner's logits against the eager runner's in fp32 (the first
# layers), decode / verify-8 / verify-16 ms against the measured memory-bandwidth floor, kernels per decode, c_d,
# step-loop overhead, plain vs speculative tokens/s at concurrency 1 and 8 with a fixed-acceptance drafter (tau 3.6)
# beside transformers' compiled static-cache generate (PEER=1), exactness against plain decoding alone, invariant vs
# fast numerics; then CUDA IPC between two processes (docs/gpu.md). Its budget is 8 minutes on one H100 or H200 (the
# smoke's 60 s and 90 s a size); this version has not run on one yet.
#
# It runs under the GPU machine's own Python and CUDA build of torch: the pins in pyproject.toml name
# the CPU build, and such machines are often offline. PYTHON picks the interpreter (default: the first
# of .venv's and python3 whose torch sees a GPU, else .venv's). Where blockspec is not installed for
# it, this checkout is put on its path as the package; besides torch it needs numpy, safetensors, tqdm,
# transformers and grpcio/protobuf, not the serving packages (pydantic, opentelemetry, ray, uvicorn, starlette).
# SIZES (default 1b,8b,27b,27b-hybrid), OUT (default gpu-check-out) and DEVICE (default cuda) are passed on; PEER=1
# adds transformers' compiled generate (its compile takes minutes a size). Each size has a budget (--budget-s, 90 s)
# past which its optional stages are left out; the table is rewritten after each size, so a run cut short keeps what
# it measured. A size that fails, a failed smoke case and logits off fp32 are said under the table (exit code 1) and
# the other sizes still run.
set -euo pipefail
cd "$(dirname "$0")/.."
sees_gpu() { "$1" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null && sees_gpu "$candidate"; then PYTHON=$candidate; break; fi
  done
  [ -n "${PYTHON:-}" ] || { [ -x .venv/bin/python ] && PYTHON=.venv/bin/python; } || PYTHON=python3
fi
if ! "$PYTHON" -c "import blockspec.services.cli" 2>/dev/null; then
  shim=$(mktemp -d)
  mkdir "$shim/blockspec"
  for part in common protos services; do ln -s "$PWD/$part" "$shim/blockspec/$part"; done
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
flags=()
if [ "${PEER:-0}" = 1 ]; then flags+=(--peer); fi
if [ "${SMOKE:-1}" = 0 ]; then flags+=(--no-smoke); fi
exec "$PYTHON" -m blockspec.services.cli gpu-check --device "${DEVICE:-cuda}" --sizes "${SIZES:-1b,8b,27b,27b-hybrid}" \
  --out "${OUT:-gpu-check-out}" "${flags[@]}"
