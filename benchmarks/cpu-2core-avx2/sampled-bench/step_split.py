"""Where a speculative step's time goes on the shipped pair: each part timed around its call (the proposal, the target
forward, the acceptance rule) over the 16 held-out prompts, k = 5, 128 new tokens, one request at a time; two passes,
the second printed last.

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-bench/step_split.py [--drafter drafter] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.drafter.proposers.dflash import DFlashProposer
from blockspec.services.engine.engine import Engine
from blockspec.services.verifier.verifier import Verifier

BASE = Path(__file__).resolve().parents[3] / "models" / "base"
spent: Counter = Counter()


def timed(owner, name: str, static: bool = False) -> None:
    """Wrap owner.name so that its seconds add up in `spent`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - started

    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="drafter", help="a directory under models/base (default: drafter)")
    parser.add_argument("--temperature", type=float, default=0.7, help="0: greedy; else rejection, request i seed i")
    args = parser.parse_args()
    timed(Verifier, "_decide", static=True)
    timed(Verifier, "_forward")
    timed(DFlashProposer, "propose")
    engine = Engine(BASE / "target", BASE / args.drafter, "dflash", max_batch=1)
    prompts = [engine.encode(json.loads(line)) for line in (BASE / "heldout_prompts.jsonl").read_text().splitlines()]
    for rep in range(2):
        spent.clear()
        started = time.perf_counter()
        done = [engine.complete([engine.request(f"{rep}-{i}", p, 128, 5, SamplingParams(temperature=args.temperature,
                                                                                          seed=i)
                                                if args.temperature else GREEDY)])[0] for i, p in enumerate(prompts)]
        elapsed = time.perf_counter() - started
        steps = sum(e.stats.steps for e in done)
        print(json.dumps({"tau": round(1 + sum(e.stats.accepted for e in done) / steps, 3),
                          "step_ms": round(elapsed / steps * 1e3, 3),
                          "proposal_ms": round(spent["propose"] / steps * 1e3, 3),
                          "target_forward_ms": round(spent["_forward"] / steps * 1e3, 3),
                          "rule_ms": round(spent["_decide"] / steps * 1e3, 3)}))


if __name__ == "__main__":
    main()
