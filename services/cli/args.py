"""What the commands share: argparse types (a flag's value checked as the parser reads it, so a bad one is exit
code 2 and one line before anything runs; bounds as the config's keys of the same names, common/config.py), the
thread setting and the prompts of a command line."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from blockspec.common.argtypes import bounded
from blockspec.common.errors import InvalidArgument
from blockspec.common.prompts import read_prompts_file

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
            "stop": "--stop", "text": "prompt", "draft_tree": "--draft-tree"}


def as_flag(field: str) -> str:
    """The flag for an engine or API field name (unchanged where no flag sets it: a path, `prompt`)."""
    if field.startswith("sampling."):
        return "--" + field.removeprefix("sampling.").replace("_", "-")
    return _FLAG_OF.get(field, field)


def set_threads(threads: int | None) -> None:
    """--threads: torch's CPU threads (None: its default)."""
    if threads is None:
        return
    if threads < 1:
        raise InvalidArgument("--threads", f"must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """A PROMPT or the prompts of --prompts-file (common/prompts.py), one of the two."""
    if prompts_file is None:
        if prompt is None:
            raise InvalidArgument("prompt", "give a PROMPT or --prompts-file")
        return [prompt]
    if prompt is not None:
        raise InvalidArgument("prompt", "give either a PROMPT or --prompts-file, not both")
    return read_prompts_file(prompts_file, "--prompts-file")


def add_tls_client_args(parser: argparse.ArgumentParser) -> None:
    """The flags of a client of a server with server.tls (common/wire/tls.py)."""
    tls = parser.add_argument_group("TLS (a server with server.tls)")
    tls.add_argument("--tls", action="store_true", help="connect over TLS, trusting the system's CAs")
    tls.add_argument("--tls-ca", help="PEM CA that signed the server's certificate (implies --tls)")
    tls.add_argument("--tls-cert", help="PEM client certificate (and its key, unless --tls-key): mutual TLS")
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert")


def client_tls(args: argparse.Namespace):
    """The ClientTls the TLS flags ask for, or None (plaintext)."""
    from blockspec.common.wire.tls import ClientTls

    if args.tls_key and not args.tls_cert:
        raise InvalidArgument("--tls-key", "goes with --tls-cert")
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise InvalidArgument(flag, f"{path}: no such file")
    if not (args.tls or args.tls_ca or args.tls_cert):
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key or args.tls_cert)
