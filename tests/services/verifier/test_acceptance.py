"""Greedy acceptance table (vLLM style): accepted prefix, then the recovered or bonus token."""

import pytest

from blockspec.services.verifier.acceptance import Acceptance, greedy_accept


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ((5, 6, 7), (5, 6, 7, 8), Acceptance(3, (5, 6, 7, 8))),  # all accepted + bonus
        ((5, 6, 7), (5, 9, 7, 8), Acceptance(1, (5, 9))),  # first mismatch at position 1 -> recovered 9
        ((5, 6, 7), (4, 6, 7, 8), Acceptance(0, (4,))),  # first token rejected
        ((5, 6, 7), (5, 6, 1, 8), Acceptance(2, (5, 6, 1))),  # mismatch at the last draft
        ((), (3,), Acceptance(0, (3,))),  # empty draft: plain decoding
        ((5,), (5, 2), Acceptance(1, (5, 2))),  # k=1 accepted + bonus
        ((5,), (6, 2), Acceptance(0, (6,))),  # k=1 rejected
        ((5, 5, 5), (5, 4, 5, 5), Acceptance(1, (5, 4))),  # later matches after a mismatch do not count
    ],
)
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(draft, target) == expected


def test_target_length_must_be_k_plus_one():
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept((1, 2), (1, 2))
