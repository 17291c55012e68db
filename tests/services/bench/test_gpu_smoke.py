"""`gpu-check`'s smoke stage (services/bench/gpu_smoke.py) on the CPU: its operators are the torch references there,
at the tiny sizes' shapes, in bf16 against fp32. Every row filled and within its tolerance; a case off its reference,
one whose rows depend on their batch and one that raises each show as failed; the time limit names what it left out."""

from __future__ import annotations

import pytest
import torch

from blockspec.common.kernels import references as kr
from blockspec.services.bench import gpu_smoke
from blockspec.services.bench.smoke_cases import CASES, TOLERANCES, Case, SmokeShapes


@pytest.fixture(scope="module")
def smoke() -> gpu_smoke.SmokeReport:
    return gpu_smoke.run_smoke("cpu", bandwidth=1e9, limit_s=None)


def test_every_case_runs_within_its_tolerance_and_the_cublas_probe_answers(smoke):
    assert [c.name for c in smoke.cases] == list(CASES) and smoke.left_out == () and smoke.passed
    for c in smoke.cases:
        assert c.failure is None and c.passed, c
        assert set(c.ms) == set(c.gb_s) == {1, 16} and all(v > 0 for v in (*c.ms.values(), *c.gb_s.values()))
        assert isinstance(c.invariant, bool) and not c.required_invariant and c.captured is None
        assert 0 <= c.error <= c.tolerance
    assert 0 < max(c.error for c in smoke.cases)  # bf16 against fp32: the comparison sees the rounding
    gemm = smoke.gemm
    assert gemm.failure is None and gemm.choice.chosen in ("cublas", "triton") and gemm.choice.settings == ()
    assert gemm.weight == (256, 64) and set(gemm.cublas_ms) == set(gemm.triton_ms) == {1, 16}
    assert smoke.versions["device"] == "cpu" and smoke.versions["torch"] == torch.__version__


def test_the_table_has_a_row_per_case_and_the_probe_line(smoke):
    text = gpu_smoke.smoke_table(smoke)
    assert "cuBLAS probe (not configured):" in text and "A 256 x 64 weight: 1 row: cuBLAS" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| operator")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(CASES) and all(r.endswith("| ok |") for r in rows)
    assert "FAILED" not in text and "Left out" not in text


def planted(op) -> dict:
    """A case of the operator `op` over x [MAX_ROWS, 8], with linear's tolerance and reference."""
    def make(s: SmokeShapes, dtype: torch.dtype, device: str) -> Case:
        x, w = torch.randn(128, 8, dtype=dtype), torch.randn(4, 8, dtype=dtype)
        return Case("linear", "8 -> 4", op, kr.linear_reference, lambda m: (x[:m], w))
    return make


def row_by_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([kr.linear_reference(row, w) for row in x])


def test_a_planted_failure_shows_as_failed(capsys):
    """Off its reference (bf16 against fp32 by more than the tolerance), rows that hang on the batch where invariance
    is required, an exception: each its row, FAILED; the others still run."""
    def off(x, w):
        return row_by_row(x, w) * 1.1

    def batch_dependent(x, w):
        return row_by_row(x, w).float() + x.shape[0] * 1e-4

    def raises(x, w):
        raise RuntimeError("no kernel image is available")

    cases = {"off": planted(off), "batch-dependent": planted(batch_dependent), "raises": planted(raises),
             "row by row": planted(row_by_row)}
    report = gpu_smoke.run_smoke("cpu", bandwidth=1e9, limit_s=None, cases=cases, require_invariance=True)
    got = {c.name: c for c in report.cases}
    assert got["off"].error > TOLERANCES["linear"] and got["off"].invariant and not got["off"].passed
    assert got["batch-dependent"].invariant is False and not got["batch-dependent"].passed
    assert got["batch-dependent"].error <= TOLERANCES["linear"]  # only its invariance fails it
    assert got["raises"].failure == "RuntimeError: no kernel image is available" and not got["raises"].passed
    assert got["row by row"].passed and got["row by row"].invariant and not report.passed
    rows = {line.split(" | ")[0][2:]: line for line in gpu_smoke.smoke_table(report).splitlines()
            if line.startswith("| ")}
    assert " | yes | " in rows["off"] and rows["off"].endswith(" | 1e-02 | FAILED |")
    assert " | yes | " in rows["row by row"] and rows["row by row"].endswith(" | 1e-02 | ok |")
    assert " | NO | " in rows["batch-dependent"] and rows["batch-dependent"].endswith(" | 1e-02 | FAILED |")
    assert rows["raises"].startswith("| raises | - |") and rows["raises"].endswith(
        "| FAILED: RuntimeError: no kernel image is available |")


def test_past_its_time_limit_the_smoke_names_what_it_left_out():
    report = gpu_smoke.run_smoke("cpu", bandwidth=1e9, limit_s=0.0)
    assert report.cases == [] and report.gemm is None and report.passed
    assert report.left_out == ("cuBLAS probe", *CASES)
    assert f"Left out of the smoke (its 0 s spent): cuBLAS probe, {', '.join(CASES)}" in gpu_smoke.smoke_table(report)


def test_the_reference_shapes_on_cuda_are_the_27b_sizes_and_qwen3_6s_experts():
    s = gpu_smoke.smoke_shapes("cuda")
    d, h, lin = s.dense, s.hybrid, s.hybrid.linear
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.intermediate_size) == (5120, 40, 8, 128, 21504)
    assert (lin.num_v_heads, lin.num_k_heads, lin.k_head_dim, lin.v_head_dim, lin.conv_kernel) == (48, 16, 128, 128, 4)
    assert (h.num_heads, h.num_kv_heads, h.head_dim) == (24, 4, 256) and s.context == 1024
    assert (s.moe.experts.num_experts, s.moe.experts.top_k, s.moe.hidden_size) == (256, 8, 2048)
    assert (43008, 5120) in gpu_smoke.runner_weights(d) and (151936, 5120) in gpu_smoke.runner_weights(d)
    assert (10240 + 6144 + 2 * 48, 5120) in gpu_smoke.runner_weights(h)  # q/k/v, z, b, a of a Gated DeltaNet layer

