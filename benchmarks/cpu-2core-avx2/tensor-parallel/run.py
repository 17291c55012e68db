"""Tensor parallelism on the CPU: the shipped pair's 16 held-out prompts, 128 greedy tokens each, batched (max_batch
16), at tensor_parallel_size 2 speculative (dflash, k 5) and plain, and at tensor_parallel_size 1 plain; one process per
size (this script runs itself for each). Prints and writes summary.json beside this file: whether speculative equals
plain at size 2 prompt by prompt, the tokens size 2 shares with size 1 (the agreement rate), and each run's tokens/s.

    .venv/bin/python benchmarks/cpu-2core-avx2/tensor-parallel/run.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
NEW = 128


def one_size(world: int) -> dict:
    from blockspec.services.engine.engine import Engine

    base = ROOT / "models" / "base"
    engine = Engine(base / "target", base / "drafter", "dflash", max_batch=16, tensor_parallel_size=world)
    prompts = [engine.encode(json.loads(line)) for line in (base / "heldout_prompts.jsonl").read_text().splitlines()]
    out = {}
    for k in ((0, 5) if world > 1 else (0,)):
        started = time.perf_counter()
        done = engine.complete([engine.request(f"{k}-{i}", p, NEW, k) for i, p in enumerate(prompts)])
        seconds = time.perf_counter() - started
        out[k] = {"tokens": [list(f.token_ids) for f in done],
                  "tokens_per_s": round(sum(len(f.token_ids) for f in done) / seconds, 1)}
    return out


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(one_size(int(sys.argv[1]))))
        return
    runs = {world: {int(k): v for k, v in json.loads(subprocess.run(
        [sys.executable, __file__, str(world)], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.splitlines()[-1]).items()} for world in (2, 1)}
    two, one = runs[2], runs[1][0]["tokens"]
    pairs = [(a, b) for x, y in zip(two[0]["tokens"], one) for a, b in zip(x, y)]
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(two[0]["tokens"], one)]
    summary = {
        "prompts": len(one), "new_tokens": NEW,
        "tp2_speculative_equals_plain": sum(a == b for a, b in zip(two[5]["tokens"], two[0]["tokens"])),
        "tp2_vs_tp1_same_tokens": sum(a == b for a, b in pairs), "tokens_compared": len(pairs),
        "tp2_vs_tp1_identical_prompts": sum(d is None for d in first_diff),
        "tp2_vs_tp1_first_difference": first_diff,
        "tokens_per_s": {"tp2_speculative": two[5]["tokens_per_s"], "tp2_plain": two[0]["tokens_per_s"],
                         "tp1_plain": runs[1][0]["tokens_per_s"]},
    }
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
