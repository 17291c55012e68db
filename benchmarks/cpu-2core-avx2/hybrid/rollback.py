"""Replay against kept per-token states for a hybrid target's rolled-back verifies: the bytes a slot holds (the
published Qwen3.5-27B and Qwen3.6-35B-A3B, bf16) and the time of a verify step with its rollback on the CPU (a small
hybrid), at k = 5 and 15, each accepted length equally often.

    .venv/bin/python benchmarks/cpu-2core-avx2/hybrid/rollback.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from blockspec.common.models.checkpoint import load_checkpoint, parse_config
from blockspec.common.models.state_cache import SlotStates
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.training.tiny import PUBLISHED, build_tiny_family

REPEATS = 40


def step_ms(runner: Runner, slot: int, prompt_len: int, k: int) -> float:
    """Median ms of: a verify forward of anchor + k drafts, then the length set to each accepted j in turn."""
    times = []
    for i in range(REPEATS):
        j = i % (k + 1)
        runner.cache.set_length(slot, prompt_len)
        t = time.perf_counter()
        runner.forward([Segment(slot, [(7 * n + 3) % 300 + 2 for n in range(k + 1)])])
        runner.cache.set_length(slot, prompt_len + 1 + j)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(out: str) -> None:
    torch.set_num_threads(1)
    result = {"bytes_per_slot_bf16_16_token_verify": {}, "cpu_step_ms": {}}
    for name in ("qwen3_5", "qwen3_5_moe"):
        cfg = parse_config(PUBLISHED[name], Path("."))
        result["bytes_per_slot_bf16_16_token_verify"][name] = {
            mode: SlotStates.nbytes(cfg, torch.bfloat16, mode, 16) for mode in ("replay", "states")}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_family(Path(tmp) / "h", "qwen3_5", hidden_size=256, num_layers=8)
        ck = load_checkpoint(path)
        prompt = [(11 * n + 5) % 300 + 2 for n in range(64)]
        with torch.inference_mode():
            for mode in ("replay", "states"):
                runner = Runner(ck, num_slots=1, max_len=256)
                runner.cache.states.rollback = mode
                slot = runner.cache.allocate()
                runner.forward([Segment(slot, prompt, last_only=True)])
                for k in (5, 15):
                    step_ms(runner, slot, len(prompt), k)  # warm
                    result["cpu_step_ms"][f"{mode} k={k}"] = round(step_ms(runner, slot, len(prompt), k), 3)
    result["cpu_target"] = "qwen3_5 shape, hidden 256, 8 layers (6 linear, 2 attention), 1 thread"
    Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
