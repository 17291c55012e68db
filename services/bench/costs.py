"""`blockspec bench`'s cost model: r(k+1) (a target forward over k + 1 tokens against one) and c_d (a drafter
proposal against one target decode), from the engine's own verifier and drafter (`gpu-check` uses it too)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

Device = tuple[torch.device, torch.dtype]  # where the engine and transformers modes run (common/device.resolve)
CPU: Device = (torch.device("cpu"), torch.float32)


@dataclass(frozen=True)
class CostModel:
    """Measured costs relative to one target decode step at the benchmark's context length."""

    context: int
    decode_ms: float  # target forward over 1 token
    r: dict[int, float]  # k -> r(k + 1): target forward over k + 1 tokens / over 1 token
    c_d: dict[int, float]  # k -> drafter proposal of k tokens / one target decode
    # Each slice's r (CostSampler): the figures above are their medians.
    r_slices: dict[int, list[float]] = field(default_factory=dict)


def cost_ratios(verifier, proposer, request_id: str, ks: Sequence[int], repeats: int, device: str = "cpu"):
    """(decode seconds, {k: r(k+1)}, {k: c_d}) for a prefilled request: every verify is rolled back to the
    same committed state first. The target's forwards are timed in interleaved rounds, each right after a
    decode: a decode follows a decode, as in plain decoding, and a verify meets the caches a target
    forward leaves (what the drafter's proposal between two verifies costs the verify is the loop's, not
    r's). Timed after the round's previous forward instead (a verify of 8 before each decode), a decode
    reads dearer than plain decoding's own in the same process, and r(8) lower with it. Each proposal is
    timed right after a verify of its width, as in the step loop. proposer=None: no c_d."""
    from blockspec.common.contracts import ProposeInput
    from blockspec.common.runtime.timing import interleaved
    from blockspec.services.verifier.verifier import rolled_back_verify

    verifier.roll_back([request_id])
    committed = list(verifier.committed(request_id))
    verifies = {k: rolled_back_verify(verifier, [request_id], k + 1) for k in (0, *ks)}
    seconds = interleaved(verifies, repeats, device, dict.fromkeys(verifies, verifies[0]))
    c_d = {}
    if proposer is not None:  # the proposal sees the committed state the verifies roll back to
        drafts = {k: lambda k=k: proposer.propose([ProposeInput(request_id, committed, k)])
                  for k in ks if k <= proposer.max_k}
        c_d = {k: s / seconds[0] for k, s in interleaved(drafts, repeats, device, verifies).items()}
    verifier.roll_back([request_id])
    return seconds[0], {k: seconds[k] / seconds[0] for k in ks}, c_d


class CostSampler:
    """r(k+1) and c_d from the engine's own verifier and dflash proposer on one prefilled request, measured in
    slices (`sample`, each one `cost_ratios`) between the rounds of the passes they are compared with: a
    cost model timed once, after a run of many minutes, met another state of a drifting machine than
    the passes did. Each slice pairs its own forwards; `model()` takes the median over the slices."""

    def __init__(self, target: Path, drafter: Path | None, ks: Sequence[int], context: int = 128,
                 device: Device = CPU) -> None:
        from blockspec.services.engine.engine import Engine

        self.engine = Engine(target, drafter, "dflash" if drafter else "none", max_batch=1, max_len=context + 32,
                             device=device[0], dtype=device[1], threads=torch.get_num_threads())
        self.device = str(device[0])
        self.engine.verifier.add("x", list(range(16, 16 + context)))
        self.engine.verifier.prefill(["x"])
        self.context, self.ks, self.with_drafter = context, list(ks), drafter is not None
        self.slices: list[tuple[float, dict[int, float], dict[int, float]]] = []

    def sample(self, repeats: int) -> None:
        proposer = self.engine.proposer if self.with_drafter else None
        self.slices.append(cost_ratios(self.engine.verifier, proposer, "x", self.ks, repeats, self.device))

    def model(self) -> CostModel:
        decode = statistics.median(s[0] for s in self.slices)
        r_slices = {k: [s[1][k] for s in self.slices] for k in self.ks}
        c_d = {k: statistics.median(s[2][k] for s in self.slices) for k in self.slices[0][2]}
        return CostModel(self.context, decode * 1e3, {k: statistics.median(v) for k, v in r_slices.items()}, c_d, r_slices)
