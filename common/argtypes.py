"""argparse types shared by the command line and the role processes it starts: a flag's value checked as the parser
reads it, so a bad one is exit code 2 and one line before anything runs."""

from __future__ import annotations

import argparse
import re

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


def draft_tree(value: str) -> tuple[int, ...]:
    """argparse type: a draft tree's children per node by depth, "N[,N...]" (each 1..16)."""
    parts = value.split(",")
    if not all(p.strip().isdecimal() and p.strip().isascii() and 1 <= int(p) <= 16 for p in parts):
        raise argparse.ArgumentTypeError(f"{value!r} is not a draft tree: children per node by depth, N[,N...] with "
                                         "each N in 1..16 (e.g. 3 or 2,2)")
    return tuple(int(p) for p in parts)


def address(value: str) -> str:
    """argparse type: HOST:PORT (port 1..65535; gRPC would wrap 99999 to 34463) or unix:PATH."""
    if value.startswith("unix:") and len(value) > len("unix:"):
        return value
    host, sep, number = value.rpartition(":")
    if not (sep and host.strip() and number.isdecimal() and number.isascii() and 1 <= int(number) <= 65535):
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT (port 1..65535) or unix:PATH")
    return value


def check_device_name(name: str, field: str = "--device") -> str:
    """The device's syntax only ("cpu", "cuda", "cuda:N"), for a flag or a config key (`field`): what can be checked
    anywhere (common/runtime/device.py checks that the device exists on this machine)."""
    if not re.fullmatch(r"cpu(:0)?|cuda(:[0-9]+)?", name):
        raise InvalidArgument(field, f"{name!r} is not a device; use cpu, cuda or cuda:N")
    return name
