"""A size's logits stage in `gpu-check` (services/bench/gpu_logits.py) on the CPU: the CUDA runner's code (uncaptured)
in fp32 and in bf16 against the eager runner in fp32, over a dense and a hybrid target cut to their first layers; a
runner off the reference fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockspec.common.runtime import backends
from blockspec.services.bench.gpu_logits import DECODES, LOGITS_TOLERANCE, PREFILL, check_logits, logits_cell


@pytest.mark.parametrize(("size", "layers"), [("tiny", 2), ("tiny-hybrid", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cuda_runners_logits_match_the_eager_runner_in_fp32(size, layers, dtype):
    check = check_logits(size, "cpu", dtype, backend="graphs")
    assert check.runner == "graphs" and check.layers == layers and check.rows == PREFILL + DECODES
    assert check.passed and 0 < check.error <= check.tolerance == LOGITS_TOLERANCE[dtype]
    if dtype == torch.float32:  # the same arithmetic in another order: every greedy token agrees
        assert check.agree == check.rows
    assert logits_cell(check) == f"{check.error:.1e} / {check.tolerance:.0e} ok, argmax {check.agree}/{check.rows}"


def test_a_runner_off_the_reference_fails(monkeypatch):
    """Logits scaled by 1.001 (a hundred times the fp32 tolerance): the check fails and its cell says so."""
    make = backends.make_runner

    def scaled(*args, **kwargs):
        runner = make(*args, **kwargs)
        forward = runner.forward

        def off(segments, tap_dest=None):
            result = forward(segments, tap_dest)
            return dataclasses.replace(result, logits=[x * 1.001 for x in result.logits])

        runner.forward = off
        return runner

    monkeypatch.setattr(backends, "make_runner", scaled)
    check = check_logits("tiny", "cpu", torch.float32, backend="graphs")
    assert not check.passed and check.error > 50 * check.tolerance and check.agree == check.rows
    assert "FAILED" in logits_cell(check)
