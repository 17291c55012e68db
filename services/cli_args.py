"""argparse types: a flag's value checked as the parser reads it, so a bad one is exit code 2 and one line before
anything runs (bounds as the config's keys of the same names: common/config.py)."""

from __future__ import annotations

import argparse
import math


def port(value: str) -> int:
    """argparse type: a TCP port (0 = any free one)."""
    number = int(value)
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: 0..65535 (0 = any free one)")
    return number


def bounded(low: int, high: int | None = None):
    """argparse type: an int in [low, high] (high None: no upper bound), as the config's key of the same name."""
    def number(value: str) -> int:
        n = int(value)
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: " + (f"{low}..{high}" if high is not None
                                                                             else f"at least {low}"))
        return n
    return number


def seconds(value: str) -> float:
    """argparse type: a finite time > 0."""
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a time in seconds > 0")
    return number
