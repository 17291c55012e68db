"""The drafters side by side on the shipped target: the 16 held-out prompts, k = 5, 128 new tokens, seed 0, greedy
and sampled at T 0.7 and 1.0 under `rejection`; tau and acceptance per drafter, and per draft slot the measured
acceptance (of the drafts that reached the slot) next to the mean of sum_x min(p(x), q(x)) over the same drafts: the
acceptance the rejection rule would give for that q, so that the gap between q and p is visible slot by slot.

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/eval.py DRAFTER_DIR [DRAFTER_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from blockspec.common.distributions import log_probs, process
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.serving.engine import Engine
from blockspec.services.verifier.verifier import Verifier

ROOT = Path(__file__).resolve().parents[3]
K, NEW = 5, 128
SETTINGS = {"greedy": GREEDY, "T 0.7": SamplingParams(temperature=0.7, seed=0, rule="rejection"),
            "T 1.0": SamplingParams(temperature=1.0, seed=0, rule="rejection")}


class SlotMeter:
    """Wraps Verifier._decide: per slot, the drafts that reached it, those accepted, and sum min(p, q)."""

    def __init__(self) -> None:
        self.reached, self.accepted, self.overlap = [0] * K, [0] * K, [0.0] * K
        self.original = Verifier._decide

    def __call__(self, state, logits, draft_ids, q, greedy=None):
        acc = self.original(state, logits, draft_ids, q, greedy)
        sp = state.sampling
        if q is None or sp.greedy or not draft_ids:
            return acc
        p = log_probs(process(logits.cpu(), state.token_ids, state.prompt_len, draft_ids, sp), sp).exp()
        for j in range(min(acc.num_accepted + 1, len(draft_ids))):  # slot j was reached
            ids, probs = q.token_ids[j], q.probs[j].double()
            self.overlap[j] += float(torch.minimum(p[j, ids], probs).sum())
            self.reached[j] += 1
            self.accepted[j] += int(j < acc.num_accepted)
        return acc


def measure(drafter: Path) -> dict:
    base = ROOT / "models" / "base"
    engine = Engine(base / "target", drafter, "dflash", max_batch=1)
    prompts = [engine.encode(json.loads(line)) for line in (base / "heldout_prompts.jsonl").read_text().splitlines()]
    out = {}
    for name, sampling in SETTINGS.items():
        meter = SlotMeter()
        Verifier._decide = staticmethod(meter)
        try:
            done = [engine.complete([engine.request(f"{name}-{i}", p, NEW, K, sampling)])[0]
                    for i, p in enumerate(prompts)]
        finally:
            Verifier._decide = staticmethod(meter.original)
        steps, drafted, accepted = (sum(getattr(e.stats, a) for e in done) for a in ("steps", "drafted", "accepted"))
        row = {"tau": round(1 + accepted / steps, 3), "acceptance": round(accepted / drafted, 3)}
        if meter.reached[0]:
            row["slots"] = [{"reached": r, "accepted": round(a / r, 3), "sum_min_p_q": round(o / r, 3)}
                            for r, a, o in zip(meter.reached, meter.accepted, meter.overlap) if r]
        out[name] = row
    return out


def main() -> None:
    results = {str(d): measure(Path(d)) for d in sys.argv[1:]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
