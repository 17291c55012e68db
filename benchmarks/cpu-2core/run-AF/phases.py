"""Per-request time split at concurrency 1, plain decoding against dflash with prompt lookup k=7, in one process:
the engine's verifier and proposer calls wrapped and timed, the modes' passes interleaved (runs AF, BENCHMARKS.md).

    python benchmarks/cpu-2core/run-AF/phases.py ROUNDS      # T=1 in the environment: one torch thread
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

import torch

from blockspec.services.engine import Engine
from blockspec.services.router.step_loop import FinishEvent

torch.set_num_threads(int(os.environ.get("T", "2")))
ENGINES = {"none": Engine(Path("models/base/target"), None, "none", max_batch=1),
           "lookup7": Engine(Path("models/base/target"), Path("models/base/drafter"), "dflash", max_batch=1,
                             prompt_lookup=True)}
K = {"none": 0, "lookup7": 7}
seconds = {name: collections.defaultdict(float) for name in ENGINES}
calls = {name: collections.defaultdict(int) for name in ENGINES}


def wrap(name: str, obj, method: str, label: str) -> None:
    inner = getattr(obj, method)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        seconds[name][label] += time.perf_counter() - started
        calls[name][label] += 1
        return out

    setattr(obj, method, timed)


def one_pass(name: str, prompts) -> float:
    engine = ENGINES[name]
    started = time.perf_counter()
    events = engine.generate([engine.request(str(i), p, 128, K[name]) for i, p in enumerate(prompts)])
    assert sum(isinstance(e, FinishEvent) for e in events) == len(prompts)
    return time.perf_counter() - started


def main(rounds: int) -> None:
    for name, engine in ENGINES.items():
        for method in ("add", "prefill", "verify", "release"):
            wrap(name, engine.verifier, method, "v." + method)
        for method in ("propose", "release"):
            wrap(name, engine.proposer, method, "d." + method)
    prompts = [ENGINES["none"].encode(json.loads(line)) for line in open("models/base/heldout_prompts.jsonl")]
    for name in ENGINES:  # warm-up, not counted
        one_pass(name, prompts)
        seconds[name].clear()
        calls[name].clear()
    total = {name: 0.0 for name in ENGINES}
    for _ in range(rounds):
        for name in ENGINES:
            total[name] += one_pass(name, prompts)
    n = len(prompts) * rounds
    for name in ENGINES:
        parts = {k: f"{1e3 * v / n:.3f} ms ({calls[name][k] / n:.1f} calls)" for k, v in seconds[name].items()}
        rest = 1e3 * (total[name] - sum(seconds[name].values())) / n
        print(f"{name}: {1e3 * total[name] / n:.2f} ms a request; {parts}; the rest {rest:.3f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
