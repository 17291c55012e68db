"""The operators' seed config (deploy/config.yaml, pointing at the shipped pair) starts the service without a warning
about itself: /health answers 503 while loading, 200 once ready, and a stream comes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockspec.protos import api_pb2
from tests.helpers import http_status, spawn_serve, stop_serve, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not (ROOT / "models" / "base" / "card.json").is_file(),
                                                  reason="models/base is not built (build-default)")]


def test_seed_config_serves_the_shipped_pair(tmp_path):
    log = (tmp_path / "serve.log").open("w+")
    info = spawn_serve("--config", "deploy/config.yaml", "--no-ray", "--port", "0", "--grpc-port", "0", cwd=ROOT,
                       stderr=log)
    try:
        assert info["before"] == 503
        assert wait_for(lambda: http_status(info["http"]) == 200)  # readiness probes each role: seconds
        prompt = json.loads((ROOT / "models" / "base" / "heldout_prompts.jsonl").read_text().splitlines()[0])
        msgs = list(info["stub"].Generate(api_pb2.GenerateRequest(text=prompt, max_tokens=32), timeout=60))
        finish = msgs[-1].finish
        assert finish.reason == "length" and finish.usage.completion_tokens == 32 and finish.acceptance.drafted > 0
        log.seek(0)
        assert [line for line in log.read().splitlines() if "WARNING" in line] == []  # from start to a served stream
    finally:
        stop_serve(info)
