"""Where a drafter's sampled tau could still come from, on the shipped target: the 16 held-out prompts, k = 5, 128 new
tokens, `rejection`, one request at a time.

* `q_temperature`: q's temperature scaled by c (the rule holds for any q the draft is sampled from): tau at seeds
  0-3 and their mean, per c.
* `first_tokens`: at every verify of seed 0, the first slot's acceptance if the drafter offered n first tokens
  judged in turn by recursive rejection (SpecInfer), from p and q at that slot: n drafts drawn from q independently
  (exact), or without replacement (q renormalised over the untried tokens; 64 Monte Carlo draws a verify).

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/headroom.py [--drafter drafter-sampled] > headroom.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from blockspec.common.runtime.distributions import log_probs, process
from blockspec.common.sampling import SamplingParams
from blockspec.services.drafter.proposers import dflash as dflash_proposer
from blockspec.services.engine.engine import Engine
from blockspec.services.verifier.verifier import Verifier

BASE = Path(__file__).resolve().parents[3] / "models" / "base"
K, NEW, SEEDS, FIRST = 5, 128, (0, 1, 2, 3), (1, 2, 3, 4)
SCALES = {0.7: (0.8, 1.0, 1.3, 1.6, 2.0), 1.0: (1.0, 1.3, 1.6)}


def tau(engine: Engine, prompts: list, temperature: float, seed: int) -> float:
    sp = SamplingParams(temperature=temperature, seed=seed, rule="rejection")
    done = [engine.complete([engine.request(f"{seed}-{i}", p, NEW, K, sp)])[0] for i, p in enumerate(prompts)]
    return round(1 + sum(e.stats.accepted for e in done) / sum(e.stats.steps for e in done), 3)


def q_temperature(engine: Engine, prompts: list) -> dict:
    """The walk's temperature for rejection rows times c (`walk_rows` is what the C++ and the torch walks read)."""
    plain, scale = dflash_proposer.walk_rows, [1.0]

    def scaled(params):
        temps, seeds, streams, keeps_q = plain(params)
        return [t * scale[0] if q else t for t, q in zip(temps, keeps_q)], seeds, streams, keeps_q

    out = {}
    dflash_proposer.walk_rows = scaled
    try:
        for temperature, scales in SCALES.items():
            for c in scales:
                scale[0] = c
                taus = [tau(engine, prompts, temperature, seed) for seed in SEEDS]
                out[f"T {temperature}, c {c}"] = {"tau_by_seed": taus, "tau_mean": round(sum(taus) / len(taus), 3)}
    finally:
        dflash_proposer.walk_rows = plain
    return out


def first_slot(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> tuple[list[float], list[float]]:
    """P(one of the first n drafts accepted), n in FIRST: independent drafts (exact), without replacement (sampled)."""
    independent, rest, missed = [], p.clone(), 1.0
    for _ in FIRST:
        accept = float(torch.minimum(rest / rest.sum(), q).sum())
        missed *= 1 - accept
        independent.append(1 - missed)
        rest = (rest / rest.sum() - q).clamp(min=0)
        if rest.sum() <= 0:
            break
    independent += [independent[-1]] * (len(FIRST) - len(independent))
    without, draws = [0.0] * len(FIRST), 64
    for _ in range(draws):
        rest, left, accepted_at = p.clone(), q.clone(), None
        for n in range(len(FIRST)):
            if left.sum() <= 0 or rest.sum() <= 0:
                break
            qn, pn = left / left.sum(), rest / rest.sum()
            x = int(torch.multinomial(qn, 1, generator=generator))
            if float(torch.rand(1, generator=generator)) * float(qn[x]) < float(pn[x]):
                accepted_at = n
                break
            rest, left = (pn - qn).clamp(min=0), left.index_fill(0, torch.tensor([x]), 0.0)
        for n in range(len(FIRST)):
            without[n] += (accepted_at is not None and accepted_at <= n) / draws
    return independent, without


class FirstSlotMeter:
    """Wraps Verifier._decide: adds up `first_slot` over every sampled verify with a draft."""

    def __init__(self) -> None:
        self.original = Verifier._decide
        self.sums = [[0.0] * len(FIRST), [0.0] * len(FIRST)]  # independent, without replacement
        self.verifies = 0
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, state, logits, draft_ids, q, greedy=None):
        acc = self.original(state, logits, draft_ids, q, greedy)
        sp = state.sampling
        if q is not None and not sp.greedy and draft_ids:
            p = log_probs(process(logits.cpu()[:1], state.token_ids, state.prompt_len, (), sp), sp).exp()[0]
            dense = torch.zeros_like(p).index_add_(0, q.token_ids[0], q.probs[0].double())
            for total, got in zip(self.sums, first_slot(p, dense, self.generator)):
                for n, value in enumerate(got):
                    total[n] += value
            self.verifies += 1
        return acc


def first_tokens(engine: Engine, prompts: list) -> dict:
    out = {}
    for temperature in SCALES:
        meter = FirstSlotMeter()
        Verifier._decide = staticmethod(meter)
        try:
            tau0 = tau(engine, prompts, temperature, 0)
        finally:
            Verifier._decide = staticmethod(meter.original)
        out[f"T {temperature}"] = {"tau_seed_0": tau0, "verifies": meter.verifies,
                                   **{f"{kind}, n {n}": round(total[i] / meter.verifies, 3)
                                      for kind, total in zip(("independent", "without replacement"), meter.sums)
                                      for i, n in enumerate(FIRST)}}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="drafter-sampled", help="a directory under models/base")
    args = parser.parse_args()
    engine = Engine(BASE / "target", BASE / args.drafter, "dflash", max_batch=1)
    prompts = [engine.encode(json.loads(line)) for line in (BASE / "heldout_prompts.jsonl").read_text().splitlines()]
    print(json.dumps({"drafter": args.drafter, "q_temperature": q_temperature(engine, prompts),
                      "first_tokens": first_tokens(engine, prompts)}, indent=1))


if __name__ == "__main__":
    main()
