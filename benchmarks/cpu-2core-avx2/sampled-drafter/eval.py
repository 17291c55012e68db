"""The drafters side by side on the shipped target: the 16 held-out prompts, k = 5, 128 new tokens, greedy and sampled
at T 0.7 and 1.0 under `rejection`; tau and acceptance per drafter at seed 0, and for the sampled settings tau at each
of --seeds and their mean, and seed 0 again with adaptive k (k up to 5, 0 where drafting does not pay) (a seed's sampled text decides which contexts the drafter meets, so one seed's tau moves by
about 0.1-0.2); per draft slot, over all the seeds, the measured acceptance (of the drafts that reached the slot) next
to the mean of sum_x min(p(x), q(x)) over the same drafts: the acceptance the rejection rule would give for that q,
so that the gap between q and p is visible slot by slot, and p's mass on q's candidates (what any q over them could
at most be accepted with). Plain decoding runs the same settings first; tokens/s of
every run leave out the slot counting's own time.

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-drafter/eval.py [--seeds 0,1,2,3] DRAFTER_DIR [DRAFTER_DIR ...]

With --draft-tree N[,N...] each drafter drafts a tree (`Engine(draft_tree=...)`): tau and tokens/s only (the slots'
figures and adaptive k are a path's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from blockspec.common.argtypes import draft_tree
from blockspec.common.runtime.distributions import log_probs, process
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.engine.engine import Engine
from blockspec.services.verifier.verifier import Verifier

ROOT = Path(__file__).resolve().parents[3]
K, NEW = 5, 128
SETTINGS = {"greedy": 0.0, "T 0.7": 0.7, "T 1.0": 1.0}


class SlotMeter:
    """Wraps Verifier._decide: per slot, the drafts that reached it, those accepted, and sum min(p, q)."""

    def __init__(self) -> None:
        self.reached, self.accepted, self.overlap, self.covered = [0] * K, [0] * K, [0.0] * K, [0.0] * K
        self.original = Verifier._decide
        self.spent = 0.0  # seconds of its own, taken out of the timings

    def __call__(self, state, logits, draft_ids, q, greedy=None):
        acc = self.original(state, logits, draft_ids, q, greedy)
        sp = state.sampling
        if q is None or sp.greedy or not draft_ids:
            return acc
        started = time.perf_counter()
        p = log_probs(process(logits.cpu(), state.token_ids, state.prompt_len, draft_ids, sp), sp).exp()
        for j in range(min(acc.num_accepted + 1, len(draft_ids))):  # slot j was reached
            ids, probs = q.token_ids[j], q.probs[j].double()
            self.overlap[j] += float(torch.minimum(p[j, ids], probs).sum())
            self.covered[j] += float(p[j, ids].sum())  # the most any q over these candidates could be accepted
            self.reached[j] += 1
            self.accepted[j] += int(j < acc.num_accepted)
        self.spent += time.perf_counter() - started
        return acc


def run(engine: Engine, prompts: list, name: str, sampling: SamplingParams, meter: SlotMeter | None) -> dict:
    """tau, acceptance and tokens/s over the prompts, one request at a time; the slots counted into meter."""
    if meter is not None:
        Verifier._decide = staticmethod(meter)
    spent = meter.spent if meter is not None else 0.0
    started = time.perf_counter()
    try:
        done = [engine.complete([engine.request(f"{name}-{i}", p, NEW, K if engine.proposer.max_k else 0, sampling)])[0]
                for i, p in enumerate(prompts)]
    finally:
        if meter is not None:
            Verifier._decide = staticmethod(meter.original)
    elapsed = time.perf_counter() - started - ((meter.spent - spent) if meter is not None else 0.0)
    steps, drafted, accepted = (sum(getattr(e.stats, a) for e in done) for a in ("steps", "drafted", "accepted"))
    return {"tau": round(1 + accepted / steps, 3), "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_s": round(sum(len(e.token_ids) for e in done) / elapsed, 1)}


def measure(drafter: Path | None, seeds: list[int], tree: tuple[int, ...] = ()) -> dict:
    """One drafter (None: plain decoding) at every setting; sampled settings at every seed."""
    base = ROOT / "models" / "base"
    engine = Engine(base / "target", drafter, "dflash" if drafter else "none", max_batch=1,
                    draft_tree=tree if drafter else ())
    prompts = [engine.encode(json.loads(line)) for line in (base / "heldout_prompts.jsonl").read_text().splitlines()]
    adaptive = Engine(base / "target", drafter, "dflash", max_batch=1, adaptive_k=True) if drafter and not tree else None
    out = {}
    for name, temperature in SETTINGS.items():
        meter = SlotMeter() if drafter and not tree else None
        if not temperature:
            out[name] = run(engine, prompts, name, GREEDY, meter)
            continue
        runs = {seed: run(engine, prompts, f"{name}-{seed}", SamplingParams(temperature=temperature, seed=seed,
                                                                              rule="rejection"), meter)
                for seed in [0, *(s for s in seeds if s != 0)]}
        out[name] = {**runs[0], "tau_by_seed": {s: r["tau"] for s, r in runs.items()},
                     "tau_mean": round(sum(r["tau"] for r in runs.values()) / len(runs), 3),
                     "tokens_per_s_mean": round(sum(r["tokens_per_s"] for r in runs.values()) / len(runs), 1)}
        if adaptive is not None:
            out[name]["adaptive_k_seed_0"] = run(adaptive, prompts, f"{name}-adaptive",
                                                 SamplingParams(temperature=temperature, seed=0, rule="rejection"), None)
        if meter is not None:
            out[name]["slots"] = [{"reached": r, "accepted": round(a / r, 3), "sum_min_p_q": round(o / r, 3),
                                   "p_on_candidates": round(c / r, 3)}
                                  for r, a, o, c in zip(meter.reached, meter.accepted, meter.overlap, meter.covered) if r]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafters", nargs="+", type=Path)
    parser.add_argument("--seeds", default="0,1,2,3", help="comma list of the sampled runs' seeds (0 always runs)")
    parser.add_argument("--draft-tree", type=draft_tree, default=(), help="N[,N...]: each drafter drafts this tree")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    label = f" tree {','.join(map(str, args.draft_tree))}" if args.draft_tree else ""
    results = {"plain decoding": measure(None, seeds)} | {f"{d}{label}": measure(d, seeds, args.draft_tree)
                                                          for d in args.drafters}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
