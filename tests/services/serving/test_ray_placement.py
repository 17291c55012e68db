"""`blockspec serve --config` on a local Ray cluster started by the test: one STRICT_PACK placement group
with a verifier and a drafter actor; streams equal the target alone; a killed drafter actor is restarted."""

from __future__ import annotations

import os
import re
import signal
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from blockspec.protos import api_pb2
from tests.helpers import CONFIG, drafted_once_back, generate, http_status, spawn_serve, stop_serve, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=["dflash", "draft_model"])
def ray_server(request, tiny_models, dflash_drafters, tmp_path_factory):
    drafter = dflash_drafters["qwen3-trained"] if request.param == "dflash" else tiny_models["qwen3"]["other"]
    cfg = tmp_path_factory.mktemp("ray") / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=drafter))
    info = spawn_serve("--config", str(cfg)) | {"method": request.param}
    yield info
    stop_serve(info)
    # The actors end by ray.kill, their gRPC servers never stop: the server deletes their sockets itself.
    assert not list(Path(tempfile.gettempdir()).glob(f"blockspec-{info['proc'].pid}-*.sock"))


def actor_pids(title: str) -> list[int]:
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(title in part for part in (p.info["cmdline"] or [])):
                pids.append(p.pid)
        except psutil.Error:
            continue
    return pids


def test_streams_over_ray_equal_the_target_alone(ray_server, prompts, references):
    assert wait_for(lambda: http_status(ray_server["http"]) == 200)  # readiness asks Ray and each role: seconds
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(ray_server["stub"], prompts[i]), range(4)))
    for i, (ids, _, finish) in enumerate(results):
        assert ids == references["qwen3"][i], f"{ray_server['method']} prompt {i}"
    assert sum(f.acceptance.drafted for _, _, f in results) > 0
    assert len(actor_pids("ray::VerifierActor")) == 1 and len(actor_pids("ray::DrafterActor")) == 1
    for title in ("ray::VerifierActor", "ray::DrafterActor"):  # on the router's host: reached on its Unix socket
        sockets = [c.laddr for c in psutil.Process(actor_pids(title)[0]).net_connections(kind="unix")
                   if "blockspec-" in (c.laddr or "")]
        assert len(sockets) >= 2 and len(set(sockets)) == 1, f"{title}: {sockets}"


def test_killed_drafter_actor_is_restarted_and_nothing_is_lost(ray_server, prompts, references):
    call = ray_server["stub"].Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[5]), max_tokens=128),
                                       timeout=120)
    ids = list(next(call).token_ids)
    (pid,) = actor_pids("ray::DrafterActor")
    os.kill(pid, signal.SIGKILL)
    ids += [t for msg in call for t in msg.token_ids]
    assert ids == references["qwen3"][5]
    # Ray restarts the actor: 9 s here idle, 137 s with both cores busy; the new actor then loads its drafter (/health
    # says 200 meanwhile, serving at k = 0), over a minute on a machine loaded past its cores.
    assert wait_for(lambda: actor_pids("ray::DrafterActor") and http_status(ray_server["http"]) == 200, 300)
    assert drafted_once_back(ray_server["stub"], prompts[7], references["qwen3"][7], 32, seconds=300) > 0, \
        "speculation must resume after Ray restarts the drafter"


def test_a_killed_verifier_actor_stops_the_server_with_exit_code_1(ray_server):
    """Ray does not restart a verifier (its KV cache and committed tokens are gone with it): the server stops with
    exit code 1, so its supervisor (KubeRay, systemd) starts it again, instead of answering 503 for ever. Last in
    this module: it ends the module's server."""
    if ray_server["method"] != "dflash":
        pytest.skip("one method is enough")
    (pid,) = actor_pids("ray::VerifierActor")
    ray_server["channel"].close()
    os.kill(pid, signal.SIGKILL)
    assert ray_server["proc"].wait(60) == 1


def test_a_role_actor_that_cannot_load_ends_serve_with_one_line_naming_its_file(tiny_models, dflash_drafters, tmp_path):
    """A checkpoint that passes the config's checks but cannot be read (truncated weights) kills the actor that
    loads it: `serve` on Ray exits 1 with one line, the role's own error (before: a 100-line Ray traceback)."""
    import shutil
    import subprocess
    import sys

    drafter = tmp_path / "drafter"
    shutil.copytree(dflash_drafters["qwen3-trained"], drafter)
    weights = drafter / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=drafter))
    proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("blockspec: error:")]
    assert re.fullmatch(r"blockspec: error: the (verifier|drafter) of replica 0 did not start: ModelLoadError: "
                        rf"{re.escape(str(weights))}: cannot read the weights \(.*\)", line), line
