"""Blue/green rollouts on `serve --no-ray` (services/serving/rollout.py): a second version starts beside the live one
and passes its checks; under a steady load it is promoted, then rolled back; no stream fails, and each stream's tokens
are one version's target alone's, the version its response metadata names."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from blockspec.protos import api_pb2
from blockspec.services.cli.main import main
from tests.helpers import CONFIG, hf_greedy, role_pids, spawn_serve, stop_serve, wait_for

KEY = "k" * 32
NEW_TOKENS = 24


def admin(port: int, method: str, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream(stub, ids: list[int]) -> tuple[str, list[int], float]:
    """(the version named in the response metadata, the tokens, when the request was sent)."""
    sent = time.monotonic()
    call = stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), max_tokens=NEW_TOKENS,
                                                 num_speculative_tokens=3), timeout=120)
    tokens = [t for msg in call for t in msg.token_ids]
    return dict(call.initial_metadata())["blockspec-version"], tokens, sent


def serve_blue(tiny_models, dflash_drafters, tmp_path, *args: str) -> dict:
    """`serve ARGS` of version blue (the tiny qwen3 pair) with a management port; info["green"]: version green's
    config (the smaller tiny target, drafted by the first), info["key_file"]: the admin key's."""
    key_file = tmp_path / "admin.key"
    key_file.write_text(KEY + "\n")
    cfg = tmp_path / "blue.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("model:\n", "model:\n  version: blue\n", 1)
                   .replace("  max_batch: 4\n", f"  max_batch: 4\n  admin: {{port: 0, key_file: {key_file}, "
                            "check_prompts: 2, check_max_tokens: 16, rollout_grace_s: 120}\n"))
    green = tmp_path / "green.yaml"  # another target (the smaller tiny model), drafted by the first one
    green.write_text(f"model:\n  version: green\n  target_model_path: {tiny_models['qwen3']['other']}\n"
                     f"  draft_model_path: {tiny_models['qwen3']['target']}\n"
                     "  spec_decode: {method: draft_model, num_speculative_tokens: 3}\n")
    info = spawn_serve("--config", str(cfg), *args)
    info.update(key_file=key_file, green=green)
    return info


@pytest.fixture(scope="module")
def served(tiny_models, dflash_drafters, tmp_path_factory):
    info = serve_blue(tiny_models, dflash_drafters, tmp_path_factory.mktemp("rollout"), "--no-ray")
    yield info
    stop_serve(info)


def test_a_rollout_under_load_promotes_and_rolls_back_with_every_stream_one_versions(served, tiny_models, prompts,
                                                                                       capsys):
    port, stub = served["admin"], served["stub"]
    chosen = prompts[:3]
    expected = {"blue": [hf_greedy(tiny_models["qwen3"]["target"], p, NEW_TOKENS) for p in chosen],
                "green": [hf_greedy(tiny_models["qwen3"]["other"], p, NEW_TOKENS) for p in chosen]}
    assert expected["blue"] != expected["green"]
    cli = ["rollout", "--admin", f"127.0.0.1:{port}", "--admin-key-file", str(served["key_file"])]

    # Only the admin key is served; a config key that belongs to the running server is refused by name.
    assert admin(port, "GET", "/v1/rollout", key=None)[0] == 401
    assert admin(port, "GET", "/v1/rollout", key="x" * 32)[0] == 401
    code, out = admin(port, "POST", "/v1/rollout", served["green"].read_bytes() + b"server: {port: 9}\n")
    assert code == 400 and out["error"]["field"] == "server.port"
    assert admin(port, "POST", "/v1/rollout/promote")[0] == 409  # nothing checked yet

    assert main([*cli, "start", "--config", str(served["green"]), "--wait", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    green = next(r for r in status["versions"] if r["version"] == "green")
    assert status["active"] == "blue" and green["state"] == "ready", status
    assert {c["name"]: c["status"] for c in green["checks"]}["identity"] == "pass"

    # A steady load: two clients, one stream after another, through the promote and the rollback.
    done, results = threading.Event(), []

    def client(i: int) -> None:
        n = 0
        while not done.is_set():
            results.append((i * 1000 + n, *stream(stub, chosen[(i + n) % len(chosen)]), (i + n) % len(chosen)))
            n += 1

    with ThreadPoolExecutor(2) as pool:
        clients = [pool.submit(client, i) for i in range(2)]
        assert wait_for(lambda: len(results) >= 2, 60)
        assert main([*cli, "promote"]) == 0
        assert wait_for(lambda: sum(r[1] == "green" for r in results) >= 3, 60)
        rollback_at = time.monotonic()
        assert main([*cli, "rollback"]) == 0
        switched_s = time.monotonic() - rollback_at
        assert wait_for(lambda: sum(r[1] == "blue" and r[3] > rollback_at for r in results) >= 3, 60)
        done.set()
        for c in clients:
            c.result()  # a stream that failed raises here
    for _, version, tokens, _, p in results:
        assert tokens == expected[version][p], f"a {version} stream differs from {version}'s target alone"
    late_green = [sent - rollback_at for _, version, _, sent, _ in results if version == "green" and sent > rollback_at]
    assert not late_green or max(late_green) <= switched_s  # none sent after the switch went to the old version
    print(f"rollback switch {switched_s * 1000:.0f} ms; {len(results)} streams, none failed")

    # The rolled-back version finishes its streams and stops: its role processes exit.
    assert wait_for(lambda: [r["version"] for r in admin(port, "GET", "/v1/rollout")[1]["versions"]] == ["blue"], 60)
    assert wait_for(lambda: not role_pids(served["proc"], "green-"), 30)
    assert len(role_pids(served["proc"], "role verifier")) == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{served['http']}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    assert 'version="green"' not in metrics and 'version="blue"' in metrics  # a stopped version's series end


def test_the_version_is_on_every_response(served):
    info, call = served["stub"].ModelInfo.with_call(api_pb2.ModelInfoRequest(), timeout=10)
    assert info.version == "blue" and dict(call.initial_metadata())["blockspec-version"] == "blue"
    body = json.dumps({"prompt": "def f(", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{served['http']}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["X-Blockspec-Version"] == "blue"
        assert json.loads(r.read())["system_fingerprint"] == "blue"
    with pytest.raises(grpc.RpcError) as e:  # an error answer carries it too
        list(served["stub"].Generate(api_pb2.GenerateRequest(), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.initial_metadata())["blockspec-version"] == "blue"


@pytest.mark.slow  # a local Ray cluster and a second version's placement group: a minute and more
def test_on_ray_a_rollout_places_the_new_version_and_a_rollback_frees_it(tiny_models, dflash_drafters, tmp_path,
                                                                          prompts):
    info = serve_blue(tiny_models, dflash_drafters, tmp_path)
    try:
        port, stub = info["admin"], info["stub"]
        expected = {"blue": hf_greedy(tiny_models["qwen3"]["target"], prompts[0], NEW_TOKENS),
                    "green": hf_greedy(tiny_models["qwen3"]["other"], prompts[0], NEW_TOKENS)}
        assert admin(port, "POST", "/v1/rollout", info["green"].read_bytes())[0] == 202
        assert wait_for(lambda: admin(port, "GET", "/v1/rollout")[1]["versions"][-1]["state"] == "ready", 300), \
            admin(port, "GET", "/v1/rollout")[1]
        assert admin(port, "POST", "/v1/rollout/promote")[0] == 200
        version, tokens, _ = stream(stub, prompts[0])
        assert (version, tokens) == ("green", expected["green"])
        assert admin(port, "POST", "/v1/rollout/rollback")[0] == 200
        version, tokens, _ = stream(stub, prompts[0])
        assert (version, tokens) == ("blue", expected["blue"])
        assert wait_for(lambda: [r["version"] for r in admin(port, "GET", "/v1/rollout")[1]["versions"]] == ["blue"],
                        60)
    finally:
        stop_serve(info)
