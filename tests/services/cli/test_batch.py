"""`blockspec batch`: an OpenAI batch file against a served pair, killed with SIGKILL and resumed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blockspec.common.errors import InvalidArgument
from blockspec.services.cli.batch import read_jobs, written_ids
from tests.helpers import CONFIG, http_status, spawn_serve, stop_serve, wait_for

pytestmark = pytest.mark.e2e
REQUESTS = 40


@pytest.fixture(scope="module")
def served(chat_target, dflash_drafters, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("batch") / "config.yaml"
    cfg.write_text(CONFIG.format(target=chat_target, drafter=dflash_drafters["qwen3-trained"]))
    info = spawn_serve("--config", str(cfg), "--inprocess")
    assert wait_for(lambda: http_status(info["http"]) == 200)
    info["config"] = cfg
    yield info
    stop_serve(info)


def batch_file(path: Path, prompts: list[list[int]]) -> Path:
    lines = []
    for i in range(REQUESTS):
        body = {"prompt": prompts[i % len(prompts)][:40] or [5], "max_tokens": 12 + i % 5, "temperature": 0}
        url = "/v1/completions"
        if i % 7 == 3:  # chat requests too
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"say {i}"}],
                                                  "max_tokens": 8, "temperature": 0}
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    lines.append({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines.append({"custom_id": "bad-type", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x", "max_tokens": -1}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(served: dict, inp: Path, out: Path, wait: bool = True) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "batch", str(inp), str(out), "--http",
                             f"127.0.0.1:{served['http']}", "--max-in-flight", "4", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        proc.wait(300)
    return proc


def texts(out: Path) -> dict[str, object]:
    """custom_id -> what the server answered (the status and the generated text), ids and times left out."""
    result = {}
    for line in out.read_text().splitlines():
        rec = json.loads(line)
        assert rec["custom_id"] not in result, f"{rec['custom_id']} written twice"
        response = rec["response"]
        if response is None:
            result[rec["custom_id"]] = ("error", rec["error"]["code"])
            continue
        body = response["body"]
        choice = (body.get("choices") or [{}])[0]
        result[rec["custom_id"]] = (response["status_code"], choice.get("text", (choice.get("message") or {})
                                                                        .get("content")))
    return result


def test_killed_three_times_and_resumed_it_writes_each_id_once(served, prompts, tmp_path):
    inp = batch_file(tmp_path / "in.jsonl", prompts)
    whole = tmp_path / "whole.jsonl"
    assert run(served, inp, whole).returncode == 0
    expected = texts(whole)
    assert len(expected) == REQUESTS + 2 and expected["bad-url"] == ("error", "invalid_request")
    assert expected["bad-type"][0] == 400  # the server refuses it: its answer is the record
    assert all(expected[f"req-{i}"][0] == 200 for i in range(REQUESTS))

    out, rng = tmp_path / "out.jsonl", random.Random(0)
    for kill in range(3):  # SIGKILL at three points of the job, each after a few more lines are written
        proc = run(served, inp, out, wait=False)
        target = (kill + 1) * REQUESTS // 4 + rng.randrange(5)
        deadline = time.monotonic() + 120
        while (not out.exists() or out.read_text().count("\n") < target) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if kill == 1:  # a torn last line, as a kill in the middle of a write leaves one
            with open(out, "a") as f:
                f.write('{"id": "batch_req_torn", "custom_id": "req-')
    sent_before = out.read_text().count("\n")
    assert sent_before < REQUESTS
    assert run(served, inp, out).returncode == 0
    assert texts(out) == expected  # every id once, the same greedy text as the uninterrupted run
    assert run(served, inp, out).returncode == 0 and texts(out) == expected  # finished: nothing more to do


def test_an_input_without_ids_or_with_one_twice_is_refused_and_bad_requests_become_error_records(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {}}\nnot json\n{"url": "/v1/completions"}\n')
    with pytest.raises(InvalidArgument, match=r"line\(s\) 2, 3 have no string custom_id"):
        read_jobs(inp)
    inp.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n' * 2)
    with pytest.raises(InvalidArgument, match=r"custom_id used twice: 'a' \(lines 1 and 2\)"):
        read_jobs(inp)
    lines = [{"custom_id": "s", "url": "/v1/completions", "body": {"stream": True}},
             {"custom_id": "g", "method": "GET", "url": "/v1/completions", "body": {}},
             {"custom_id": "b", "url": "/v1/completions", "body": "prompt"},
             {"custom_id": "ok", "url": "/v1/chat/completions", "body": {"messages": []}}]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [j.problem for j in read_jobs(inp)] == ["body.stream: a batch request is not streamed",
                                                   "method 'GET': only POST",
                                                   "body: expected an object (the endpoint's request)", None]


def test_a_torn_last_line_is_cut_and_complete_ones_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    assert written_ids(out) == {"a", "b"} and out.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n'
    assert written_ids(tmp_path / "none.jsonl") == set()


def test_a_config_serves_the_job_itself(served, prompts, tmp_path):
    """--config starts the config's server for the job (free ports, one process) and stops it: the same answers as
    the running server's."""
    lines = batch_file(tmp_path / "all.jsonl", prompts).read_text().splitlines()[:6]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    by_server, by_config = tmp_path / "server.jsonl", tmp_path / "config.jsonl"
    assert run(served, inp, by_server).returncode == 0
    done = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "batch", str(inp), str(by_config), "--config",
                           str(served["config"]), "--quiet"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert texts(by_config) == texts(by_server) and len(texts(by_config)) == 6


def test_each_port_refuses_the_other_protocols_client_in_one_line(served, tmp_path):
    """batch sends /v1 requests to the HTTP port (--http), generate calls the gRPC port (--server): pointed at the
    other port each says so in one line, exit code 2, nothing written (batch at the gRPC port was an http.client
    BadStatusLine traceback, generate at the HTTP port gRPC's UNAVAILABLE, exit 1). batch --server, the gRPC port's
    flag everywhere else, is refused naming --http."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}})
                   + "\n")
    grpc_port, http_port = f"127.0.0.1:{served['grpc']}", f"127.0.0.1:{served['http']}"
    for argv, message in (
            (["batch", str(inp), str(out), "--http", grpc_port],
             f"--http: {grpc_port} speaks gRPC, not HTTP: --http takes the server's HTTP port; the gRPC port "
             "(server.grpc_port, default 8001) goes to --server of generate, bench and validate"),
            (["batch", str(inp), str(out), "--server", http_port],
             "--server: names a server's gRPC API (generate, bench, validate); batch sends /v1 requests to its HTTP "
             "port: give --http HOST:PORT"),
            (["generate", "hi", "--server", http_port],
             f"--server: {http_port} speaks HTTP, not gRPC: --server takes the server's gRPC port; the HTTP port "
             "(server.port, default 8000) goes to --http of batch and validate")):
        done = subprocess.run([sys.executable, "-m", "blockspec.services.cli", *argv, *(["--quiet"] if argv[0] ==
                              "batch" else [])], capture_output=True, text=True, timeout=120, check=False)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"blockspec: error: {message}\n"), argv
        assert not out.exists()
