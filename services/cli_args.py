"""argparse types: a flag's value checked as the parser reads it, so a bad one is exit code 2 and one line before
anything runs (bounds as the config's keys of the same names: common/config.py)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from blockspec.common.errors import InvalidArgument


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


def address(value: str) -> str:
    """argparse type: HOST:PORT (port 1..65535; gRPC would wrap 99999 to 34463) or unix:PATH."""
    if value.startswith("unix:") and len(value) > len("unix:"):
        return value
    host, sep, number = value.rpartition(":")
    if not (sep and host.strip() and number.isdecimal() and number.isascii() and 1 <= int(number) <= 65535):
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (port 1..65535) or unix:PATH")
    return value


MAX_THREADS = 256  # --threads: past a few thousand, OpenMP cannot create them (20,000: an error; 100,000: a crash)
UINT32, UINT64 = 2**32 - 1, 2**64 - 1  # the gRPC API's integer fields (a larger value cannot be sent at all)


def threads(value: str) -> int:
    """argparse type: torch CPU threads, 1..MAX_THREADS."""
    return bounded(1, MAX_THREADS)(value)


def seconds(value: str, unit: str = "seconds") -> float:
    """argparse type: a finite time > 0."""
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a time in {unit} > 0")
    return number


def minutes(value: str) -> float:
    """argparse type: a finite time > 0, in minutes."""
    return seconds(value, "minutes")


def out_dir(text: str) -> Path:
    """--out, made now: a path that cannot be a directory fails before the run, not after it (InvalidArgument)."""
    out = Path(text)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgument("--out", f"cannot make directory {text!r}: {e.strerror or e}") from None
    return out


# What the engine and the gRPC API call the settings the CLI's flags give (sampling.X is --X): `generate`'s and
# `role`'s errors name the flag the user typed instead.
_FLAG_OF = {"k": "-k", "num_speculative_tokens": "-k", "max_tokens": "--max-tokens", "max_model_len": "--max-model-len",
            "prompt_lookup_tokens": "--prompt-lookup-tokens", "drafter": "--drafter", "method": "--method",
            "stop": "--stop", "text": "prompt"}


def as_flag(field: str) -> str:
    """The flag for an engine or API field name (unchanged where no flag sets it: a path, `prompt`)."""
    if field.startswith("sampling."):
        return "--" + field.removeprefix("sampling.").replace("_", "-")
    return _FLAG_OF.get(field, field)
