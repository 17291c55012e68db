"""Timing of short calls for the cost model and the benchmarks: medians over interleaved rounds, CUDA work waited
for, so that a machine that speeds up or slows down meanwhile shifts every timed call alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int, device: str = "cpu", warm_up: bool = True) -> float:
    """Median seconds per call of fn over `repeats` calls, after one warm-up call (CUDA work waited for)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if warm_up:
        fn()
        sync()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def interleaved(fns: dict, repeats: int, device: str = "cpu", before: dict | None = None) -> dict:
    """Median seconds per call of each fn: one untimed round first, then `repeats` rounds that each time
    every fn once, so a machine that speeds up or slows down meanwhile shifts all of them alike.
    before[key], where given, runs untimed just before its fn (the state the fn should meet)."""
    samples: dict = {key: [] for key in fns}
    for round_ in range(repeats + 1):
        for key, fn in fns.items():
            if before and key in before:
                timed(before[key], 1, device, warm_up=False)  # waited for, not counted
            seconds = timed(fn, 1, device, warm_up=False)
            if round_:
                samples[key].append(seconds)
    return {key: statistics.median(s) for key, s in samples.items()}
