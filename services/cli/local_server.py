"""A config served for the length of one command (`batch --config`, `validate --config`): `serve --inprocess` as a
child process on free ports of 127.0.0.1, stopped when the command ends."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from blockspec.common.errors import InvalidArgument


@dataclass(frozen=True)
class LocalServer:
    http: str  # HOST:PORT of /health, /metrics and /v1
    grpc: str  # HOST:PORT of the gRPC API


@contextmanager
def served(config: str) -> Iterator[LocalServer]:
    """`blockspec serve --config CONFIG --inprocess` on free ports of 127.0.0.1, once it serves; SIGTERM at the end.
    A server that exits before it serves is InvalidArgument on --config (its own error is on stderr above)."""
    import yaml

    from blockspec.common.config import load_config

    doc = load_config(config).model_dump(mode="json")
    doc["server"].update(host="127.0.0.1", port=0, grpc_port=0)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", f.name,
                                 "--inprocess"], stdout=subprocess.PIPE, text=True)
        ports = next((dict(p.split("=") for p in line.split()[1:]) for line in proc.stdout
                      if line.startswith("SERVING ")), None)  # SERVING grpc=<port> http=<port>
    finally:
        os.unlink(f.name)
    if ports is None:
        raise InvalidArgument("--config", f"the server did not start (exit code {proc.wait()}); its error is above")
    try:
        yield LocalServer(http=f"127.0.0.1:{ports['http']}", grpc=f"127.0.0.1:{ports['grpc']}")
    finally:
        proc.terminate()
        proc.wait(60)
