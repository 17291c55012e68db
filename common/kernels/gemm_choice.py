"""Whether torch's own products (cuBLAS) are row-invariant for a model's weight shapes: cuBLAS configured without
split-K reductions, then the product of the first m rows compared bit for bit with the same rows of a product over
more rows. Its answer names the GEMM a batch-invariant linear can use: "cublas" where every row matched, else
"triton"."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# A decode, two requests, a verify block of 16, eight requests' blocks, a prefill chunk.
ROWS = (1, 2, 16, 128, 2048)
# The environment vLLM's batch-invariant mode sets on Hopper and Blackwell: cuBLAS and cuBLASLt workspaces too small
# for a split-K reduction's partials (8 x 16 KiB; 1 KiB).
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


@dataclass(frozen=True)
class GemmChoice:
    chosen: str  # "cublas": every product probed was row-invariant and repeatable; "triton" otherwise
    shapes: tuple[tuple[int, int], ...]  # the weights probed, (N, K): out features, in features
    rows: tuple[int, ...]  # the row counts probed, each against the largest
    mismatch: str | None  # the first product that differed, where one did
    seconds: float  # the probe's time, the products' first calls included
    settings: tuple[str, ...] = ()  # how cuBLAS was configured first (empty: not configured, e.g. off CUDA)


def configure_cublas() -> tuple[str, ...]:
    """Configure this process's cuBLAS as vLLM's batch-invariant mode does on Hopper and Blackwell
    (`enable_batch_invariant_mode` in vllm/model_executor/layers/batch_invariant.py): `CUBLAS_WORKSPACE_CONFIG=:16:8`
    and `CUBLASLT_WORKSPACE_SIZE=1` (KiB), no reduced-precision or split-K reductions in bf16 and fp16 products
    (`allow_bf16_reduced_precision_reduction = (False, False)`, the tuple form of PyTorch 2.10 on,
    pytorch/pytorch#164766) and cuBLASLt preferred. torch reads both variables once, at the process's first product:
    call this before any. Needs a CUDA build of torch. Returns the settings made, as text."""
    os.environ.update(CUBLAS_ENV)
    matmul = torch.backends.cuda.matmul
    try:
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        matmul.allow_fp16_reduced_precision_reduction = (False, False)
        reductions = "allow_bf16/fp16_reduced_precision_reduction=(False, False)"
    except (TypeError, RuntimeError):  # a torch before 2.10 takes a bool only
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
        reductions = "allow_bf16/fp16_reduced_precision_reduction=False"
    torch.backends.cuda.preferred_blas_library("cublaslt")
    return (*(f"{k}={v}" for k, v in CUBLAS_ENV.items()), reductions, "preferred_blas_library=cublaslt")


def first_mismatch(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                   rows: Sequence[int]) -> str | None:
    """Where linear(x[:m], w) differs from the first m rows of linear(x, w) for an m in rows, or two calls over all of
    x differ: that product, in words; None where every one matched bit for bit."""
    full = linear(x, w)
    if not torch.equal(linear(x, w), full):
        return f"N {w.shape[0]}, K {w.shape[1]}: two products of {x.shape[0]} rows differ"
    for m in rows:
        part = linear(x[:m], w)
        if not torch.equal(part, full[:m]):
            row = int((part != full[:m]).flatten(1).any(dim=1).nonzero()[0, 0])
            return f"N {w.shape[0]}, K {w.shape[1]}: row {row} of {m} rows differs from the same row of {x.shape[0]}"
    return None


def choose_gemm(shapes: Sequence[tuple[int, int]], device: torch.device | str = "cuda",
                dtype: torch.dtype = torch.bfloat16, rows: Sequence[int] = ROWS,
                linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
                configure: bool | None = None, seed: int = 0) -> GemmChoice:
    """Probe `linear` (torch's product: cuBLAS on CUDA) for each weight shape (N, K) with random inputs of max(rows)
    rows: "cublas" where every row count in rows gave the same rows as the largest, bit for bit, and repeated products
    were equal; "triton" at the first that did not. configure (default: on CUDA) runs `configure_cublas` first. The
    answer holds for the shapes and row counts probed, in this process's configuration."""
    device = torch.device(device)
    started = time.perf_counter()
    settings = configure_cublas() if (device.type == "cuda" if configure is None else configure) else ()
    gen = torch.Generator(device=device).manual_seed(seed)
    mismatch = None
    with torch.inference_mode():
        for n, k in shapes:
            w = torch.randn((n, k), generator=gen, device=device, dtype=dtype) * 0.02
            x = torch.randn((max(rows), k), generator=gen, device=device, dtype=dtype)
            mismatch = first_mismatch(linear, x, w, rows)
            del w, x
            if mismatch is not None:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return GemmChoice("triton" if mismatch else "cublas", tuple((int(n), int(k)) for n, k in shapes), tuple(rows),
                      mismatch, time.perf_counter() - started, settings)
