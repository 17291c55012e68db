"""Measure whether a (k+1)-token verify and 1-token decodes give the same logits (greedy exactness across query width)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.runtime.runner import Runner, Segment


@dataclass(frozen=True)
class InvarianceReport:
    mode: str  # "default" or "invariant"
    positions: int  # positions compared
    argmax_mismatches: int
    max_abs_diff: float  # largest |verify logit - decode logit|

    @property
    def mismatch_rate(self) -> float:
        return self.argmax_mismatches / self.positions if self.positions else 0.0


def verify_vs_decode(runner: Runner, prefix: Sequence[int], block: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [len(block), vocab] of `block` after `prefix`: one verify forward, and one forward per token."""
    slot = runner.cache.allocate()
    try:
        runner.forward([Segment(slot, list(prefix))])
        verify = runner.forward([Segment(slot, list(block))]).logits[0]
        runner.cache.set_length(slot, len(prefix))
        decode = torch.cat([runner.forward([Segment(slot, [t])]).logits[0] for t in block])
    finally:
        runner.cache.release(slot)
    return verify, decode


def measure(
    checkpoint: Checkpoint, sequences: Sequence[Sequence[int]], ks: Sequence[int], invariant: bool, stride: int = 16
) -> InvarianceReport:
    """Compare verify and decode logits for every k at positions `stride` apart along each token sequence."""
    positions = mismatches = 0
    max_diff = 0.0
    for k in ks:
        runner = Runner(checkpoint, num_slots=1, query_width=k + 1 if invariant else None)
        for seq in sequences:
            for cut in range(1, len(seq) - k - 1, stride):
                if cut + k + 1 > runner.max_len:
                    break
                verify, decode = verify_vs_decode(runner, seq[:cut], seq[cut : cut + k + 1])
                positions += k + 1
                mismatches += int((verify.argmax(-1) != decode.argmax(-1)).sum())
                max_diff = max(max_diff, float((verify - decode).abs().max()))
    return InvarianceReport("invariant" if invariant else "default", positions, mismatches, max_diff)
