"""The router's HTTP front (uvicorn): what a hostile or broken client does to it. Every test here is a defect a probe
found: a listen backlog of 5, connections held open by trickled header bytes, a stalled body ending in a 500 and a
traceback, header bytes that reached gRPC metadata or a response header raw, chunked bodies ignored, a drafter restart
answered 503, request heads of any size held whole, a long Authorization answered as a rate limit, a text/plain body
read as JSON, and top_p 0 served as top_p 1."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time
import urllib.request

import psutil
import pytest

from blockspec.services.router import openai_http
from blockspec.services.router.http import BACKLOG, MAX_HEAD_BYTES, Ready, start_http
from tests.helpers import Served


@pytest.fixture
def front():
    server = start_http("127.0.0.1", 0, lambda: Ready(True, "ready\n"), head_timeout_s=1.0)
    yield server
    server.shutdown()


def exchange(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes or `timeout` (a response without Connection: close: its head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and b"Connection: close" not in data and data.endswith(b"}"):
                    break
        except TimeoutError:
            pass
    return data


@pytest.fixture(scope="module")
def v1(tiny_models):
    """A router with the /v1 paths behind the HTTP front, plain decoding of the tiny qwen3 target."""
    from blockspec.services.engine.engine import Engine

    served = Served(Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=2))
    yield served
    served.close()


def post(port: int, headers: bytes, body: bytes) -> tuple[bytes, bytes]:
    """A POST /v1/completions with the given extra header lines: the status line and the body of the answer."""
    reply = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"Content-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
    return reply.partition(b"\r\n")[0], reply.partition(b"\r\n\r\n")[2]


def test_an_idle_connection_does_not_hold_up_the_health_probe(front):
    port = front.server_port
    idle = socket.create_connection(("127.0.0.1", port))  # connected, sends nothing (a stuck scraper)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200 and resp.read() == b"ready\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200 and b"# TYPE" in resp.read()
    finally:
        idle.close()


def test_the_listen_backlog_holds_200_simultaneous_probes(front):
    """The kernel's accept queue is BACKLOG deep (capped by somaxconn), not 5: 200 probes connecting at once are all
    queued and answered, none waits out a dropped SYN's 1 s retransmission. The queue length is the listening
    socket's tcp_info (tcpi_sacked holds a listener's maximum backlog)."""
    info = front.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    with open("/proc/sys/net/core/somaxconn") as f:
        assert struct.unpack_from("I", info, 28)[0] == min(BACKLOG, int(f.read()))
    answers: list[tuple[int, float]] = []
    barrier = threading.Barrier(200)

    def probe():
        barrier.wait()
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{front.server_port}/health", timeout=30) as resp:
                answers.append((resp.status, time.monotonic() - started))
        except OSError as e:
            answers.append((repr(e), time.monotonic() - started))

    threads = [threading.Thread(target=probe) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted({status for status, _ in answers}, key=str) == [200] and len(answers) == 200
    print(f"200 simultaneous /health: slowest {max(s for _, s in answers) * 1000:.0f} ms")


def test_a_client_that_trickles_its_head_is_cut_off(front):
    """A byte every 0.2 s never completes a head: the connection is closed at the head deadline (1 s here), on a
    new connection and on a kept-alive one after its first answer."""
    with socket.create_connection(("127.0.0.1", front.server_port), timeout=10) as s:
        started = time.monotonic()
        closed_after = None
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 60:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.2)
            except OSError:
                closed_after = time.monotonic() - started
                break
        if closed_after is None:  # the writes may still succeed once; the read sees the close
            s.settimeout(5)
            assert s.recv(100) == b""
            closed_after = time.monotonic() - started
    assert closed_after < 5
    with socket.create_connection(("127.0.0.1", front.server_port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"ready\n"):  # head and body may come in two reads
            answer += s.recv(1000)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")  # the next head, never finished
        s.settimeout(5)
        assert s.recv(100) == b""


def test_a_stalled_body_is_408_without_a_traceback(tiny_models, monkeypatch, caplog):
    from blockspec.services.engine.engine import Engine

    monkeypatch.setattr(openai_http, "BODY_TIMEOUT_S", 1.0)
    caplog.set_level(logging.DEBUG)
    served = Served(Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1))
    try:
        reply = exchange(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        status, _, body = reply.partition(b"\r\n")[0], None, reply.partition(b"\r\n\r\n")[2]
        assert status == b"HTTP/1.1 408 Request Timeout" and b"connection: close" in reply.lower()
        assert json.loads(body)["error"]["param"] == "body"
        chunked = chunked_completion(served.port, served.client.models.list().data[0].id)
        assert chunked["usage"]["completion_tokens"] >= 1
    finally:
        served.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a client's bytes are not a server error"


def chunked_completion(port: int, model: str) -> dict:
    """A body sent with Transfer-Encoding: chunked is read whole (before: ignored, an empty body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    parts = [b'{"model": ' + json.dumps(model).encode(), b', "prompt": "def add", ', b'"max_tokens": 3}']
    conn.request("POST", "/v1/completions", body=iter(parts), headers={"Content-Type": "application/json"},
                 encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return json.loads(response.read())


@pytest.mark.parametrize("name, value", [("Authorization", b"Bearer caf\xc3\xa9-key"),
                                         ("X-Request-Id", b"id\xe9"), ("X-Request-Id", b"id\x01\x02"),
                                         ("Authorization", b"Bearer a\x00b")])
def test_header_bytes_that_are_not_printable_ascii_are_400_and_never_echoed(tiny_models, name, value):
    """Before: a non-ASCII Authorization was a 500 ("Invalid metadata") and an X-Request-Id with control bytes came
    back raw in a response header and the completion id. Now: 400 naming the header (h11 refuses control bytes
    itself), nothing echoed."""
    from blockspec.services.engine.engine import Engine

    served = Served(Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1))
    try:
        body = b'{"prompt": "hi", "max_tokens": 2}'
        reply = exchange(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      + name.encode() + b": " + value + b"\r\nContent-Length: "
                                      + str(len(body)).encode() + b"\r\n\r\n" + body)
    finally:
        served.close()
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    assert value not in reply
    if b"\x00" not in value and b"\x01" not in value:  # ours, as an OpenAI error naming the header
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["param"] == name


def test_health_says_degraded_while_serving_without_the_drafter(monkeypatch):
    from blockspec.services.serving import serve

    class Role:
        def __init__(self, up: bool) -> None:
            self.up, self.address = up, "x"

    class Router:
        @staticmethod
        def stalled(limit_s: float) -> bool:
            return False

    monkeypatch.setattr(serve, "_answers", lambda role: role.up)
    state = {"router": None, "replicas": [(Role(True), Role(False))]}
    readiness = serve._readiness(state)
    assert readiness() == Ready(False, "starting\n")
    state["router"] = Router()
    assert readiness().serving and readiness().degraded and "replica 0: drafter" in readiness().detail
    state["replicas"] = [(Role(False), Role(True))]
    assert not readiness().serving
    state["replicas"] = [(Role(False), Role(True)), (Role(True), Role(True))]
    assert readiness() == Ready(True, "degraded: replica 0: verifier not answering (the other replicas serve)\n",
                                degraded=True)
    state["replicas"] = [(Role(True), Role(True))]
    assert readiness() == Ready(True, "ok\n")
    state["replicas"] = []  # --inprocess: no role to ask
    assert readiness() == Ready(True, "ok\n")


@pytest.mark.parametrize("head", [b"X-Big: " + b"a" * (8 << 20) + b"\r\n", b"X-A: b\r\n" * 200_000,
                                  b"X-Big: " + b"a" * MAX_HEAD_BYTES + b"\r\n"],
                         ids=["one-8MiB-header", "200k-headers", "just-over-the-limit"])
def test_a_head_over_the_limit_is_431_and_its_connection_closed(front, head):
    """Before: any head was read whole (a 64 MiB header answered 200 after 6 s, a million headers took 97 MiB)."""
    reply = exchange(front.server_port, b"GET /health HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), reply[:100]
    assert b"connection: close" in reply and reply.endswith(b"(the request line and headers)\n")  # then closed


def test_a_head_within_the_limit_is_served_and_the_next_one_on_the_connection_is_bounded_too(front):
    near = b"X-Big: " + b"a" * (MAX_HEAD_BYTES - 200) + b"\r\n"
    with socket.create_connection(("127.0.0.1", front.server_port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + near + b"\r\n")
        answer = b""
        while not answer.endswith(b"ready\n"):
            answer += s.recv(1000)
        assert answer.startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + near * 2 + b"\r\n")
        answer = b""
        while chunk := s.recv(1000):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 431")


def test_parallel_large_heads_leave_the_servers_memory_bounded(front):
    """Twenty connections each sending a 16 MiB header at once (before: the process grew by hundreds of MiB until
    the head deadline)."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (16 << 20) + b"\r\n\r\n"
    process = psutil.Process()
    before = process.memory_info().rss
    replies: list[bytes] = []

    def send() -> None:
        try:
            replies.append(exchange(front.server_port, head)[:40])
        except OSError as e:  # the server closed while this client still sent: refused too
            replies.append(repr(e).encode())

    threads = [threading.Thread(target=send) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    grown = (process.memory_info().rss - before) / 2**20
    assert len(replies) == 20 and all(r.startswith(b"HTTP/1.1 431") or b"Error" in r for r in replies), replies
    assert grown < 64, f"the process grew {grown:.0f} MiB"


def test_an_authorization_header_over_the_limit_is_431_naming_it_not_a_rate_limit(v1):
    """Before: over 16 KB it reached gRPC's metadata limit and came back 429 rate_limit_error, which clients retry."""
    body = b'{"prompt": "hi", "max_tokens": 2}'
    status, answer = post(v1.port, b"Content-Type: application/json\r\nAuthorization: Bearer " + b"k" * 20000
                          + b"\r\n", body)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    error = json.loads(answer)["error"]
    assert error["param"] == "Authorization" and error["type"] == "invalid_request_error"
    status, _ = post(v1.port, b"Content-Type: application/json\r\nAuthorization: Bearer " + b"k" * 3000 + b"\r\n",
                     body)
    assert status == b"HTTP/1.1 200 OK"  # a long token within the limit (no keys configured: any key serves)


@pytest.mark.parametrize(("content_type", "status"), [(b"text/plain", b"415"), (b"application/x-www-form-urlencoded",
                                                      b"415"), (b"application/json; charset=utf-8", b"200"),
                                                     (None, b"200")])
def test_a_body_that_is_not_sent_as_json_is_415(v1, content_type, status):
    """Before: any Content-Type was read as JSON. Absent, the body is read as JSON."""
    line = b"" if content_type is None else b"Content-Type: " + content_type + b"\r\n"
    got, answer = post(v1.port, line, b'{"prompt": "hi", "max_tokens": 2}')
    assert got.startswith(b"HTTP/1.1 " + status), (got, answer)
    if status == b"415":
        assert json.loads(answer)["error"]["param"] == "Content-Type"


def test_top_p_0_is_the_most_likely_token_alone_never_the_whole_distribution(v1, prompts, references, tokenizer):
    """Before: top_p 0 went to gRPC, where 0 means unset, and sampled from everything at temperature 1."""
    model = v1.client.models.list().data[0].id
    for seed in (1, 2, 3):
        out = v1.client.completions.create(model=model, prompt=prompts[3], max_tokens=24, temperature=1.0, top_p=0,
                                           seed=seed)
        assert out.choices[0].text == tokenizer.decode(references["qwen3"][3][:24], skip_special_tokens=True)


def test_health_names_replicas_as_the_router_does_and_stays_degraded_until_a_lost_one_is_replaced(monkeypatch):
    """Before: a lost replica left the pairs at once and /health said ok while its replacement started (17 s in the
    probe); a replica was named by its position among the pairs, not by its name."""
    from blockspec.services.serving import serve

    class Role:
        def __init__(self, up: bool) -> None:
            self.up, self.address = up, "x"

    class ServedVersion:
        def __init__(self, pairs: dict[str, tuple]) -> None:
            self.pairs, self.names = list(pairs.values()), {id(p): name for name, p in pairs.items()}

        def replica_name(self, pair: tuple) -> str:
            return self.names[id(pair)]

    class Router:
        @staticmethod
        def stalled(limit_s: float) -> bool:
            return False

    class Autoscaler:
        replacing: list[str] = []

    monkeypatch.setattr(serve, "_answers", lambda role: role.up)
    fleet, autoscaler = type("Fleet", (), {})(), Autoscaler()
    fleet.active = ServedVersion({"1": (Role(True), Role(True)), "2": (Role(False), Role(True))})
    state = {"router": Router(), "replicas": [], "fleet": fleet, "autoscaler": autoscaler}
    readiness = serve._readiness(state)
    assert readiness().detail == "degraded: replica 2: verifier not answering (the other replicas serve)\n"
    fleet.active = ServedVersion({"1": (Role(True), Role(True))})  # replica 2 lost: out of the pairs
    autoscaler.replacing = ["2"]
    assert readiness() == Ready(True, "degraded: replica 2: verifier lost, its replacement is starting (the other "
                                      "replicas serve)\n", degraded=True)
    fleet.active = ServedVersion({"1": (Role(True), Role(True)), "3": (Role(True), Role(False))})
    autoscaler.replacing = []  # replica 3 ready in its place
    assert readiness().detail == "degraded: replica 3: drafter not answering (requests run at k=0)\n"
