"""The chunked gated delta rule against the token-by-token one: outputs and final state within rounding, padding that
leaves a row's state alone, and a row's result independent of the rows beside it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.common.kernels.delta_rule import delta_rule_chunked, delta_rule_steps, l2_normalise

# Max abs error over the max abs of the recurrent result, outputs and final state, fp32. Measured: at most 2e-6 over
# these cases and chunks of 32 and 64 (dk up to 128, T up to 512, correlated keys).
TOLERANCE = 1e-5


def inputs(seed: int, B: int, T: int, H: int, dk: int, dv: int, decay_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random inputs of a Gated DeltaNet layer: l2-normalised keys and queries (scaled), log decays -softplus(x) of
    about [-5, 0] (times decay_scale), write strengths sigmoid(x), a non-zero initial state."""
    gen = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(B, H, dk, dv, generator=gen) * 0.1,
            "k": l2_normalise(torch.randn(B, T, H, dk, generator=gen)),
            "v": torch.randn(B, T, H, dv, generator=gen),
            "g": -F.softplus(2 * torch.randn(B, T, H, generator=gen) - 1) * decay_scale,
            "beta": torch.sigmoid(torch.randn(B, T, H, generator=gen)),
            "q": l2_normalise(torch.randn(B, T, H, dk, generator=gen)) / dk ** 0.5}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("T", [1, 7, 31, 32, 33, 64, 100, 200])
@pytest.mark.parametrize(("H", "dk", "dv"), [(1, 16, 16), (3, 16, 24), (2, 64, 32)])
@pytest.mark.parametrize("chunk", [32, 64])
def test_outputs_and_state_equal_the_recurrence(T, H, dk, dv, chunk):
    x = inputs(T, 2, T, H, dk, dv)
    want_out, want_state = delta_rule_steps(**x)
    out, state = delta_rule_chunked(**x, chunk=chunk)
    assert out.shape == want_out.shape and state.shape == want_state.shape
    assert relative_error(out, want_out) <= TOLERANCE
    assert relative_error(state, want_state) <= TOLERANCE


def test_the_layer_shape_of_a_large_model():
    """dk = dv = 128 as Qwen3.5's layers, T spanning several chunks with a tail."""
    x = inputs(0, 1, 300, 4, 128, 128)
    want_out, want_state = delta_rule_steps(**x)
    out, state = delta_rule_chunked(**x)
    assert relative_error(out, want_out) <= TOLERANCE
    assert relative_error(state, want_state) <= TOLERANCE


@pytest.mark.parametrize("decay_scale", [0.0, 20.0])
def test_no_decay_and_decays_that_underflow(decay_scale):
    """g = 0 (nothing forgotten) and g down to about -100 a token, whose within-chunk products underflow to 0: finite
    and equal to the recurrence."""
    x = inputs(1, 2, 90, 2, 16, 16, decay_scale)
    want_out, want_state = delta_rule_steps(**x)
    out, state = delta_rule_chunked(**x)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    assert relative_error(out, want_out) <= TOLERANCE
    assert relative_error(state, want_state) <= TOLERANCE


def test_without_queries_only_the_state():
    x = inputs(2, 1, 70, 2, 16, 16)
    del x["q"]
    out, state = delta_rule_chunked(**x)
    assert out is None
    assert relative_error(state, delta_rule_steps(**x)[1]) <= TOLERANCE


def test_padding_leaves_a_shorter_rows_state_and_its_result_is_that_of_the_row_alone():
    """Row 1 holds 45 tokens of 150, then padding (g = beta = 0, other inputs arbitrary, as a batch's padding
    tokens): its state is the recurrence's over its own tokens, and its outputs and state are bitwise those of the
    row run alone (the padding's chunks change nothing; the matmuls of one row do not depend on the rows beside it)."""
    x = inputs(3, 2, 150, 3, 32, 16)
    real = 45
    x["g"][1, real:] = 0
    x["beta"][1, real:] = 0
    out, state = delta_rule_chunked(**x)
    alone = {name: t[1:, :real] if name != "state" else t[1:] for name, t in x.items()}
    want_out, want_state = delta_rule_steps(**alone)
    assert relative_error(state[1:], want_state) <= TOLERANCE
    assert relative_error(out[1:, :real], want_out) <= TOLERANCE
    out_alone, state_alone = delta_rule_chunked(**alone)
    assert torch.equal(state[1:], state_alone)
    assert torch.equal(out[1:, :real], out_alone)
    first = {name: t[:1] for name, t in x.items()}
    out_first, state_first = delta_rule_chunked(**first)
    assert torch.equal(state[:1], state_first) and torch.equal(out[:1], out_first)
