"""`blockspec serve --config ... --no-ray` as a user runs it: real processes, ports, health, faults."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest

from blockspec.protos import api_pb2
from tests.helpers import (
    CONFIG,
    config_with_a_broken_drafter,
    drafted_once_back,
    generate,
    http_status,
    role_pids,
    spawn_serve,
    stop_serve,
    wait_for,
)

pytestmark = pytest.mark.e2e

@pytest.fixture(scope="module")
def server(tiny_models, dflash_drafters, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("serve") / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"]))
    info = spawn_serve("--config", str(cfg), "--no-ray")
    yield info
    stop_serve(info)


def test_health_503_then_200_and_streams_equal_the_target_alone(server, prompts, references):
    assert server["before"] == 503
    assert wait_for(lambda: http_status(server["http"]) == 200)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda i: generate(server["stub"], prompts[i]), range(3)))
    for i, (ids, _, finish) in enumerate(results):
        assert ids == references["qwen3"][i]
        assert finish.acceptance.drafted > 0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server['http']}/metrics").read().decode()
    assert "blockspec_spec_decode_num_draft_tokens_total" in metrics


def test_the_openai_api_is_served_on_the_http_port(server, prompts, references, tokenizer):
    """`serve` wires /v1/completions to its own router: the target alone's text, as on gRPC."""
    body = json.dumps({"prompt": prompts[4], "max_tokens": 128, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server['http']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        out = json.loads(r.read())
    assert out["choices"][0]["text"] == tokenizer.decode(references["qwen3"][4], skip_special_tokens=True)
    assert out["usage"]["completion_tokens"] == len(references["qwen3"][4]) and out["acceptance"]["drafted"] > 0


def test_role_processes_get_a_short_openmp_spin_unless_the_operator_sets_one(server, monkeypatch):
    """Both roles start with launch.ROLE_ENV_DEFAULTS (libgomp threads that sleep soon after a forward, so three
    processes can share the cores); a value in the server's environment is passed on instead."""
    from blockspec.services.serving.launch import ROLE_ENV_DEFAULTS, role_env

    want = os.environ.get("GOMP_SPINCOUNT", ROLE_ENV_DEFAULTS["GOMP_SPINCOUNT"])  # serve got this test's environment
    for role in ("role verifier", "role drafter"):
        (pid,) = role_pids(server["proc"], role)
        assert psutil.Process(pid).environ().get("GOMP_SPINCOUNT") == want
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    assert role_env() == {"GOMP_SPINCOUNT": "123"}
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert role_env() == ROLE_ENV_DEFAULTS


def role_socket_use(pid: int) -> tuple[str | None, int, list]:
    """A role's Unix socket path (its --unix-socket), how many sockets it holds on that path (listening and
    accepted) and its TCP connections other than the listening one."""
    proc = psutil.Process(pid)
    argv = proc.cmdline()
    path = argv[argv.index("--unix-socket") + 1] if "--unix-socket" in argv else None
    held = sum(1 for c in proc.net_connections(kind="unix") if path and c.laddr == path)
    return path, held, [c for c in proc.net_connections(kind="tcp") if c.status != psutil.CONN_LISTEN]


def test_the_router_reaches_its_roles_on_unix_sockets(server, prompts, references):
    """Roles on the router's host are reached on a Unix domain socket (a round trip 0.02-0.09 ms shorter than
    over TCP loopback here); their TCP port stays open, unused by the router."""
    assert generate(server["stub"], prompts[0])[0] == references["qwen3"][0]
    for role in ("role verifier", "role drafter"):
        (pid,) = role_pids(server["proc"], role)
        path, held, tcp = role_socket_use(pid)
        assert path and stat.S_ISSOCK(os.stat(path).st_mode), role
        assert held >= 2 and not tcp, f"{role}: {held} sockets on {path}, TCP connections {tcp}"


def test_the_roles_answer_only_their_server(server):
    """`serve` makes up a key for the roles it starts ($BLOCKSPEC_ROLE_KEY, in their environment): another process
    that reaches a role's socket gets UNAUTHENTICATED for every method but health."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from blockspec.common.wire.auth import ENV_ROLE_KEY
    from blockspec.protos import roles_grpc, roles_pb2

    (pid,) = role_pids(server["proc"], "role verifier")
    assert len(psutil.Process(pid).environ().get(ENV_ROLE_KEY, "")) >= 16
    path, _, _ = role_socket_use(pid)
    with grpc.insecure_channel(f"unix:{path}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            roles_grpc.VerifierStub(channel).Info(roles_pb2.InfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_role_sockets_of_gone_servers_are_removed(tmp_path, monkeypatch):
    """A killed server's role sockets (and those of Ray actors ended by ray.kill) are deleted: at the next start
    those whose server no longer runs, at a Ray server's stop its own."""
    import tempfile

    from blockspec.services.serving.launch import remove_role_sockets

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = [f"blockspec-{int(gone.stdout)}-verifier-0.sock", f"blockspec-{os.getpid()}-drafter-0.sock",
             "blockspec-x-drafter-0.sock", f"other-{int(gone.stdout)}-verifier-0.sock"]
    for name in names:
        (tmp_path / name).touch()
    assert remove_role_sockets() == [names[0]]
    assert remove_role_sockets(os.getpid()) == [names[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_killing_the_drafter_mid_stream_loses_nothing_and_speculation_resumes(server, prompts, references):
    call = server["stub"].Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[6]), max_tokens=128),
                                   timeout=120)
    ids = list(next(call).token_ids)
    (pid,) = role_pids(server["proc"], "role drafter")
    os.kill(pid, signal.SIGKILL)
    finish = None
    for msg in call:
        ids += msg.token_ids
        if msg.HasField("finish"):
            finish = msg.finish
    assert ids == references["qwen3"][6], "output must not change when the drafter dies"
    assert finish is not None
    # The supervisor restarts the drafter; the router reconnects.
    assert wait_for(lambda: role_pids(server["proc"], "role drafter") and http_status(server["http"]) == 200)
    assert drafted_once_back(server["stub"], prompts[7], references["qwen3"][7], 64) > 0, \
        "speculation must resume after the drafter restarts"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server['http']}/metrics").read().decode()
    fallbacks = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("blockspec_drafter_fallbacks_total")]
    assert fallbacks and fallbacks[0] > 0


def test_roles_stop_when_the_server_is_killed(tiny_models, dflash_drafters, tmp_path):
    """SIGKILL gives the server no chance to stop its roles: they see their supervisor gone and stop themselves
    (none is left holding its port and memory)."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"]))
    info = spawn_serve("--config", str(cfg), "--no-ray")
    pids = role_pids(info["proc"], "role verifier") + role_pids(info["proc"], "role drafter")
    assert len(pids) == 2
    sockets = [role_socket_use(pid)[0] for pid in pids]
    info["channel"].close()
    info["proc"].kill()
    info["proc"].wait(10)
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids], timeout=30)
    for proc in alive:
        proc.kill()
    assert not alive, "role processes outlived their server"
    assert all(sockets) and not [path for path in sockets if os.path.exists(path)], f"Unix sockets left: {sockets}"


def test_cancelled_streams_leave_no_slot_or_segment_behind(server, prompts):
    segments_before = sorted(p for p in os.listdir("/dev/shm") if p.startswith("blockspec-"))
    for _ in range(100):
        call = server["stub"].Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[2]), max_tokens=128),
                                       timeout=60)
        next(call)
        call.cancel()
    for _ in range(100):
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server['http']}/metrics").read().decode()
        used = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("blockspec_kv_slots_used")]
        if used and used[0] == 0:
            break
        time.sleep(0.1)
    assert used == [0.0]
    assert sorted(p for p in os.listdir("/dev/shm") if p.startswith("blockspec-")) == segments_before
    # and the server still answers
    assert generate(server["stub"], prompts[1], 8)[2] is not None


def test_cli_generate_through_the_server(server, tiny_models, tokenizer, capsys):
    import json

    from blockspec.services.cli.main import main
    from tests.helpers import hf_greedy

    address = f"127.0.0.1:{server['grpc']}"
    assert main(["generate", "def f(x):", "--server", address, "--max-tokens", "24", "-k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(tiny_models["qwen3"]["target"], tokenizer.encode("def f(x):"), 24)
    assert out["stats"]["drafted"] > 0 and set(out["stats"]) >= {"tau", "acceptance_rate", "accepted_per_pos"}
    assert 0 < out["stats"]["ttft_s"] < out["stats"]["elapsed_s"]  # as the client saw it
    assert main(["generate", "hi", "--server", address, "-k", "99"]) == 2  # the server's INVALID_ARGUMENT, one line
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("blockspec: error: -k: must be between 0 (plain decoding) and "), last  # named as the flag


def test_bench_measures_the_server_with_latency(server, tmp_path, capsys):
    """`blockspec bench --server`: the same workload over gRPC, per k and concurrency, passes interleaved, with TTFT
    and TPOT as the client sees them; k=0 (plain decoding on the same server) is the baseline of the ratios and of
    `exact`. A server that cannot be reached or refuses a k is a clear error, not a traceback."""
    from blockspec.services.cli.main import main

    assert main(["bench", "--server", "127.0.0.1:1", "--server-k", "3,-1"]) == 2
    assert "--server-k" in capsys.readouterr().err
    assert main(["bench", "--server", "127.0.0.1:1", "--num-prompts", "1"]) == 1
    assert "server 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def wrap(self, text):\\n"\n"class TextWrapper:\\n    "\n')
    common = ["--prompts-file", str(prompts), "--max-tokens", "16", "--waves", "1", "--out", str(tmp_path / "out")]
    assert main(["bench", "--server", f"127.0.0.1:{server['grpc']}", "--server-k", "99", "--concurrency", "1", *common]) == 2
    assert "--server-k: num_speculative_tokens: must be between 0 (plain decoding) and" in capsys.readouterr().err
    assert main(["bench", "--server", f"127.0.0.1:{server['grpc']}", "--concurrency", "1", "--rounds", "1", *common]) == 0
    by_default = (tmp_path / "out" / "bench.md").read_text()  # 0 and the server's default k (ModelInfo)
    assert "| server | 1 |" in by_default and "| server k=5 | 1 |" in by_default
    assert main(["bench", "--server", f"127.0.0.1:{server['grpc']}", "--server-k", "1,0", "--concurrency", "1,2",
                 "--request-rates", "30", "--max-concurrency", "2", "--rounds", "2", *common]) == 0
    report = (tmp_path / "out" / "bench.md").read_text()
    closed, open_loop = report.split("Open loop")
    rows = [line.strip(" |").split(" | ") for line in closed.splitlines() if line.startswith("| server")]
    assert [(r[0], r[1]) for r in rows] == [("server", "1"), ("server k=1", "1"), ("server", "2"), ("server k=1", "2")]
    assert [r[4] for r in rows[::2]] == ["1.00x", "1.00x"] and all(r[4].endswith("x") for r in rows)  # vs plain
    assert all(len(r[3].split("-")) == 2 for r in rows)  # the passes' min-max: two rounds
    # Open loop: requests sent at 30 per second, at most 2 streams; mode, rate, cap, ..., TTFT, TPOT, tau, exact.
    rate_rows = [line.strip(" |").split(" | ") for line in open_loop.splitlines() if line.startswith("| server")]
    assert [(r[0], r[1], r[2]) for r in rate_rows] == [("server", "30", "2"), ("server k=1", "30", "2")]
    assert all(0 < float(r[6].split(" / ")[0]) and r[-1] == "yes" for r in rate_rows)
    for r in rows:  # mode, concurrency, tokens/s, passes, vs plain, TTFT, TPOT, ITL, tau, acceptance, per position, exact
        (ttft, ttft_p99), (tpot, tpot_p99), (itl, itl_p99) = (map(float, cell.split(" / ")) for cell in r[5:8])
        assert 0 < ttft <= ttft_p99 and 0 < tpot and 0 < tpot_p99 and 0 < itl <= itl_p99 and r[-1] == "yes"
    assert [r[8] for r in rows[::2]] == ["-", "-"] and all(float(r[8]) >= 1 for r in rows[1::2])  # tau: k=1 rows
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(saved["rows"]) == 4 and len(saved["rows"][0]["rounds"]) == 2
    assert (tmp_path / "out" / "tokens_per_s.png").is_file()
    # Sampled requests, request i seeded SEED + i: under strict every k must give plain decoding's text.
    assert main(["bench", "--server", f"127.0.0.1:{server['grpc']}", "--server-k", "0,3", "--concurrency", "1",
                 "--rounds", "1", "--temperature", "0.8", "--rule", "strict", "--seed", "7", *common]) == 0
    sampled = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert sampled["sampling"]["temperature"] == 0.8 and [r["exact"] for r in sampled["rows"]] == [True, True]
    assert "rule `strict`, request i seeded 7 + i" in (tmp_path / "out" / "bench.md").read_text()


def test_a_server_with_api_keys_serves_only_clients_that_send_one(tiny_models, dflash_drafters, tokenizer, tmp_path,
                                                                   monkeypatch, capsys):
    """server.api_keys_file end to end: the public API and /metrics refuse a call without a known key, health
    answers anyone, and `blockspec generate --server` sends $BLOCKSPEC_API_KEY."""
    from blockspec.common.wire.auth import ENV_API_KEY
    from blockspec.services.cli.main import main
    from tests.helpers import hf_greedy

    key = "serve-test-key-0123456789"
    (tmp_path / "keys").write_text(f"team-a {key}\n")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("  max_batch: 4", f"  max_batch: 2\n  api_keys_file: {tmp_path / 'keys'}"))
    info = spawn_serve("--config", str(cfg), "--no-ray")
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(info["stub"], [5, 6, 7], 4)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert http_status(info["http"]) == 200 and http_status(info["http"], "/metrics") == 401
        address = f"127.0.0.1:{info['grpc']}"
        assert main(["generate", "hi", "--server", address, "--max-tokens", "4"]) == 1
        assert "UNAUTHENTICATED: missing or unknown API key" in capsys.readouterr().err
        monkeypatch.setenv(ENV_API_KEY, key)
        assert main(["generate", "def f(x):", "--server", address, "--max-tokens", "16", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == hf_greedy(tiny_models["qwen3"]["target"], tokenizer.encode("def f(x):"), 16)
    finally:
        stop_serve(info)


def test_two_replicas_share_the_load_and_stay_exact(tiny_models, dflash_drafters, tmp_path, prompts, references):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("  max_batch: 4", "  max_batch: 2\n  replicas: 2"))
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        info = spawn_serve("--config", str(cfg), "--no-ray", stderr=stderr)
    try:
        assert len(role_pids(info["proc"], "role verifier")) == 2 and len(role_pids(info["proc"], "role drafter")) == 2
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: generate(info["stub"], prompts[i], 64), range(4)))
        for i, (ids, _, _) in enumerate(results):
            assert ids == references["qwen3"][i][:64]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['http']}/metrics").read().decode()
        assert 'blockspec_requests_running{replica="0",' in metrics and 'blockspec_requests_running{replica="1",' in metrics
    finally:
        stop_serve(info)
    # A clean stop: the router closed its role streams before the roles stopped (an open one is cancelled, and
    # grpc logs an ERROR with a traceback in the role).
    assert "Traceback" not in log.read_text() and "ERROR" not in log.read_text(), log.read_text()[-2000:]


def test_a_drafter_that_cannot_restart_leaves_the_server_serving_and_a_dead_verifier_exits_1(
        tiny_models, dflash_drafters, tmp_path, prompts, references):
    """The supervisor's three cases: a stopped verifier turns /health and the router's gRPC health NOT_SERVING (and
    back); a drafter whose restart fails leaves the server serving at k=0 and is tried again until it starts; a
    verifier that exits ends the server with exit code 1 (systemd's Restart=on-failure then starts it again)."""
    import shutil

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    drafter = tmp_path / "drafter"
    shutil.copytree(dflash_drafters["qwen3-trained"], drafter)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=drafter))
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        info = spawn_serve("--config", str(cfg), "--no-ray", stderr=stderr)
    health = health_pb2_grpc.HealthStub(info["channel"])

    def states():
        return http_status(info["http"]), health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        (verifier,) = role_pids(info["proc"], "role verifier")
        os.kill(verifier, signal.SIGSTOP)
        try:
            assert wait_for(lambda: states() == (503, not_serving)), states()
        finally:
            os.kill(verifier, signal.SIGCONT)
        assert wait_for(lambda: states() == (200, serving)), states()

        drafter.rename(tmp_path / "moved")  # the drafter's restart cannot load it
        (pid,) = role_pids(info["proc"], "role drafter")
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: "restarting a drafter failed" in log.read_text())
        with urllib.request.urlopen(f"http://127.0.0.1:{info['http']}/health", timeout=5) as resp:
            assert resp.status == 200 and resp.read().startswith(b"degraded: replica 0: drafter not answering")
        assert states() == (200, serving)  # a load balancer keeps the replica: it serves every request at k=0
        ids, _, finish = generate(info["stub"], prompts[7], 32)
        assert info["proc"].poll() is None and ids == references["qwen3"][7][:32] and finish.acceptance.drafted == 0
        (tmp_path / "moved").rename(drafter)
        assert wait_for(lambda: role_pids(info["proc"], "role drafter") and http_status(info["http"]) == 200)
        assert drafted_once_back(info["stub"], prompts[7], references["qwen3"][7], 32) > 0, "the drafter is back"

        info["channel"].close()
        os.kill(verifier, signal.SIGKILL)
        assert info["proc"].wait(30) == 1
    finally:
        if info["proc"].poll() is None:
            stop_serve(info)


def test_a_router_alone_waits_for_its_roles_and_names_one_that_never_answers(tiny_models, dflash_drafters, tmp_path,
                                                                             monkeypatch, caplog):
    """`serve --verifier-address` whose verifier is not there: the router says it is waiting, then ends the start
    with one line naming the flag and the address (before: minutes of silence, then a traceback)."""
    import logging

    from blockspec.common.config import load_config
    from blockspec.services.serving import serve

    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"]))
    monkeypatch.setattr(serve, "EXTERNAL_START_S", 1.5)
    caplog.set_level(logging.INFO, logger="blockspec.services.serving.serve")
    with pytest.raises(serve.RoleStartError, match=r"--verifier-address 127.0.0.1:1: no role answered there within 1.5 s"):
        serve.serve_external(load_config(cfg), "127.0.0.1", 0, 0, "127.0.0.1:1", "127.0.0.1:2")
    assert "waiting for the role at 127.0.0.1:1 (--verifier-address)" in caplog.text


def test_a_taken_port_ends_serve_with_one_line(tiny_models, dflash_drafters, tmp_path):
    """HTTP or gRPC port held by another process: exit code 1 and one line naming the address (before: a traceback;
    the roles started before the gRPC bind are stopped with it)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for key in ("port", "grpc_port"):
            cfg = tmp_path / f"{key}.yaml"
            cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                           .replace(f"  {key}: 0\n", f"  {key}: {port}\n"))
            proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(cfg),
                                   "--no-ray", "--host", "127.0.0.1"], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
            assert f"blockspec: error: cannot bind 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]


def test_a_router_alone_serves_roles_started_elsewhere(tiny_models, dflash_drafters, tmp_path, prompts, references):
    """`serve --verifier-address --drafter-address` (the compose deployment): streams equal the target alone; a
    config whose role-side keys the running roles do not have is named in a warning, with the role command lines
    it implies (the roles run with their own); a verifier that is gone ends the router with exit code 1."""
    from blockspec.services.serving.serve import RoleProcess

    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-trained"])
    common = ["--target", target, "--method", "dflash", "--drafter", drafter, "--max-batch", "2"]
    roles = [RoleProcess("verifier-x", ("role", "verifier", *common)), RoleProcess("drafter-x", ("role", "drafter", *common))]
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=target, drafter=drafter))  # max_batch 4: more than the verifier's 2 slots
    log = tmp_path / "serve.log"
    try:
        with log.open("w") as stderr:
            info = spawn_serve("--config", str(cfg), "--verifier-address", roles[0].address, "--drafter-address",
                               roles[1].address, stderr=stderr)
        try:
            ids, _, finish = generate(info["stub"], prompts[3], 64)
            roles[0].proc.kill()  # the verifier is gone: the router exits 1 for its supervisor to restart both
            code = info["proc"].wait(60)
        finally:
            if info["proc"].poll() is None:
                stop_serve(info)
    finally:
        for role in roles:
            role.stop()
    assert ids == references["qwen3"][3][:64] and finish.acceptance.drafted > 0 and code == 1
    text = log.read_text()
    assert "server.max_batch 4 > its 2 slots" in text and "role verifier --target" in text


def test_a_drafter_that_cannot_load_ends_serve_with_one_line_naming_its_file(tiny_models, dflash_drafters, tmp_path):
    """At start-up a drafter checkpoint that cannot be read ends `serve` with exit code 1: the role names the file
    it could not read, the server the role that ended (before: two tracebacks, neither naming the checkpoint)."""
    cfg, weights = config_with_a_broken_drafter(tiny_models, dflash_drafters, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(cfg), "--no-ray"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{weights}: cannot read the weights" in proc.stderr
    # The verifier reads the drafter's checkpoint too (its tap layers): whichever role starts first says so.
    assert re.search(r"blockspec: error: the (verifier|drafter)-0 role exited before serving \(code 2\); its error is "
                     r"above", proc.stderr)


def test_the_roles_are_stopped_together_not_one_after_another():
    """Each role's stop waits for its process to exit; before, serve stopped them in turn and an idle server took over
    5 s to exit on SIGTERM. Three stops that each wait for the others to have begun only finish together."""
    import threading

    from blockspec.services.serving.serve import stop_together

    begun = threading.Barrier(3, timeout=10)

    class Role:
        stopped = False

        def stop(self) -> None:
            begun.wait()  # BrokenBarrierError where the stops run one after another
            self.stopped = True

    roles = [Role() for _ in range(3)]
    stop_together(roles)
    assert all(role.stopped for role in roles)
