"""`blockspec serve --config ... --inprocess`: the router and both roles in one process, as a user runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.helpers import CONFIG, config_with_a_broken_drafter, generate, http_status, spawn_serve, stop_serve, wait_for

pytestmark = pytest.mark.e2e


def serve_exit(cfg, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_inprocess_serves_the_target_alones_text_with_no_role_process(tiny_models, dflash_drafters, tmp_path, prompts,
                                                                       references):
    """One process: /health 503 while the engine loads, then 200; concurrent streams equal the target alone's
    greedy text with drafts accepted; /metrics (the process's memory as role "server") and /v1 as with role
    processes; SIGTERM ends it with code 0."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"]))
    server = spawn_serve("--config", str(cfg), "--inprocess")
    try:
        assert server["before"] == 503
        assert psutil.Process(server["proc"].pid).children() == []  # no role processes
        assert wait_for(lambda: http_status(server["http"]) == 200)
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: generate(server["stub"], prompts[i]), range(3)))
        for i, (ids, _, finish) in enumerate(results):
            assert ids == references["qwen3"][i]
            assert finish.acceptance.drafted > 0 and finish.acceptance.accepted > 0
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server['http']}/metrics").read().decode()
        assert "blockspec_spec_decode_num_draft_tokens_total" in metrics
        rss = re.search(r'blockspec_role_memory_bytes\{kind="rss",replica="0",role="server",version="[^"]+"\} (\S+)', metrics)
        assert rss and float(rss.group(1)) > 1e6  # the one process's memory, as role "server"
        body = json.dumps({"prompt": prompts[4], "max_tokens": 16, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server['http']}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 16
    finally:
        stop_serve(server)
    assert server["proc"].returncode == 0


def test_inprocess_refuses_what_it_cannot_serve_naming_the_flag_or_key(tiny_models, dflash_drafters, tmp_path):
    """With a flag for the role processes (--no-ray) or more than one replica: exit code 2, one line naming it."""
    text = CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    proc = serve_exit(cfg, "--inprocess", "--no-ray")
    assert proc.returncode == 2 and "blockspec: error: --inprocess: " in proc.stderr and "--no-ray" in proc.stderr
    two = tmp_path / "two.yaml"
    two.write_text(text.replace("  max_batch: 4\n", "  max_batch: 4\n  replicas: 2\n"))
    proc = serve_exit(two, "--inprocess")
    assert proc.returncode == 2 and "blockspec: error: server.replicas: 2: with --inprocess" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_inprocess_with_a_drafter_that_cannot_load_ends_with_one_line_naming_its_file(tiny_models, dflash_drafters,
                                                                                    tmp_path):
    """No role to report it: the engine's own error, one line, exit code 2 (as any bad input to the CLI)."""
    cfg, weights = config_with_a_broken_drafter(tiny_models, dflash_drafters, tmp_path)
    proc = serve_exit(cfg, "--inprocess")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{weights}: cannot read the weights" in proc.stderr
