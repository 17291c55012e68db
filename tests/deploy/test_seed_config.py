"""The operators' seed config (deploy/config.yaml, pointing at the shipped pair) starts the service:
/health answers 503 while loading, 200 once ready, and a stream comes back."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from blockspec.protos import api_grpc, api_pb2
from tests.services.test_serve import http_status

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not (ROOT / "models" / "base" / "card.json").is_file(),
                                                  reason="models/base is not built (build-default)")]


def test_seed_config_serves_the_shipped_pair():
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", "deploy/config.yaml",
                             "--no-ray", "--port", "0", "--grpc-port", "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        before = None
        for line in proc.stdout:
            if line.startswith("HTTP "):
                http = int(line.split()[1])
                before = http_status(http)
            if line.startswith("SERVING "):
                grpc_port = int(line.split()[1].split("=")[1])
                break
        assert before == 503
        assert http_status(http) == 200
        stub = api_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        msgs = list(stub.Generate(api_pb2.GenerateRequest(text="def main():\n", max_tokens=32), timeout=60))
        assert msgs[-1].finish.usage.completion_tokens == 32 and msgs[-1].finish.acceptance.drafted > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
