"""Sampling parameters (common/sampling.py): a bad value refused naming its field, a seed resolved."""

from __future__ import annotations

import math

import pytest

from blockspec.common.errors import InvalidArgument
from blockspec.common.sampling import SamplingParams, checked


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -1.0}, "sampling.temperature"), ({"temperature": math.inf}, "sampling.temperature"),
    ({"temperature": 1e-320}, "sampling.temperature: must be 0 (greedy) or at least 1e-05"),
    ({"top_p": 0.0}, "sampling.top_p"), ({"top_k": -2}, "sampling.top_k"), ({"rule": "typical"}, "sampling.rule"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"), ({"presence_penalty": 3.0}, "sampling.presence_penalty"),
    ({"no_repeat_ngram_size": -1}, "sampling.no_repeat_ngram_size"), ({"logit_bias": ((500, 1.0),)}, "sampling.logit_bias"),
    ({"logit_bias": ((5, 1000.0),)}, "sampling.logit_bias"), ({"seed": -1}, "sampling.seed"),
    ({"logprobs": 21}, "sampling.logprobs: must be in [0, 20], got 21"), ({"logprobs": -1}, "sampling.logprobs"),
])
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as e:
        checked(SamplingParams(**kwargs), vocab_size=320)
    assert str(e.value).startswith(field)


def test_logprobs_cross_the_wire_unset_zero_or_twenty():
    from blockspec.common.sampling import fill_pb, from_pb
    from blockspec.protos import api_pb2

    for logprobs in (None, 0, 20):
        pb = api_pb2.SamplingParams()
        fill_pb(SamplingParams(logprobs=logprobs), pb)
        assert from_pb(pb).logprobs == logprobs
        assert checked(from_pb(pb), 10).logprobs == logprobs


def test_validation_resolves_a_seed_when_sampling():
    assert checked(SamplingParams(temperature=1.0), 10).seed is not None
    assert checked(SamplingParams(), 10).seed is None
