"""The cuBLAS row-invariance probe (common/kernels/gemm_choice.py) where the CPU can check it: it finds a product
whose rows depend on the row count, accepts one whose rows do not, and configures cuBLAS as vLLM's batch-invariant
mode does. Whether cuBLAS itself passes needs a GPU (`blockspec gpu-check`'s smoke stage)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from blockspec.common.kernels import gemm_choice
from blockspec.common.kernels.gemm_choice import choose_gemm, first_mismatch

SHAPES = [(96, 64), (48, 128)]


def row_alone(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A product computing each row by itself: its rows cannot depend on the others."""
    return torch.stack([F.linear(row, w) for row in x])


def count_dependent(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A product whose rows move by an epsilon that grows with the row count (as a split-K chosen by it would)."""
    return row_alone(x, w) + x.shape[0] * 1e-3


def test_a_product_whose_rows_hang_on_the_row_count_is_found_and_triton_chosen():
    choice = choose_gemm(SHAPES, "cpu", torch.float32, rows=(1, 2, 16), linear=count_dependent)
    assert choice.chosen == "triton" and choice.settings == ()
    assert choice.mismatch == "N 96, K 64: row 0 of 1 rows differs from the same row of 16"
    assert choice.shapes == tuple(SHAPES) and choice.rows == (1, 2, 16) and choice.seconds > 0


def test_a_row_invariant_product_is_accepted_and_cublas_chosen():
    choice = choose_gemm(SHAPES, "cpu", torch.float32, rows=(1, 2, 16, 128), linear=row_alone)
    assert choice.chosen == "cublas" and choice.mismatch is None


def test_the_mismatch_names_the_first_row_that_differs_and_a_product_that_does_not_repeat():
    w, x = torch.randn(8, 4), torch.randn(16, 4)

    def late_row(x, w):
        out = row_alone(x, w)
        if x.shape[0] == 2:
            out[1] += 1.0
        return out

    assert first_mismatch(late_row, x, w, (1, 2, 16)) == "N 8, K 4: row 1 of 2 rows differs from the same row of 16"
    calls = []

    def drifting(x, w):
        calls.append(1)
        return row_alone(x, w) + len(calls)

    assert first_mismatch(drifting, x, w, (1,)) == "N 8, K 4: two products of 16 rows differ"


def test_configure_sets_the_workspaces_and_the_reductions_vllm_sets(monkeypatch):
    """The settings without a CUDA build: the environment, the reduction flags (restored after), the library asked."""
    asked = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", asked.append)
    for name in gemm_choice.CUBLAS_ENV:
        monkeypatch.delenv(name, raising=False)
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    try:
        settings = gemm_choice.configure_cublas()
        assert not matmul.allow_bf16_reduced_precision_reduction
        assert not matmul.allow_fp16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = saved
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1"
    assert asked == ["cublaslt"] and settings[:2] == ("CUBLAS_WORKSPACE_CONFIG=:16:8", "CUBLASLT_WORKSPACE_SIZE=1")

