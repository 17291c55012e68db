"""TLS and mutual TLS with certificates made here (trustme): HTTPS through the OpenAI client and gRPC through the
stubs, every refusal (plaintext, a wrong CA, no, an expired or an unknown client certificate) counted and logged with
the peer, certificates rotated while a stream runs, and `serve` with its role hops over TCP under mutual TLS."""

from __future__ import annotations

import datetime
import http.client
import json
import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request

import grpc
import openai
import pytest
import trustme

from blockspec.common.wire.tls import HANDSHAKE_FAILURES, ClientTls, ServerTls, secure_channel
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.engine.engine import Engine
from blockspec.services.router.http import Ready, start_http
from blockspec.services.router.openai_http import Upstream, V1App
from tests.helpers import RouterThread, wait_for


class Certs:
    """A CA, the server's certificate (127.0.0.1, localhost), clients' certificates: good, expired, another CA's."""

    def __init__(self, root) -> None:
        self.root = root
        self.ca, self.other_ca = trustme.CA(), trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem)
        self.server = self._leaf(self.ca, "server.pem")
        self.client = self._leaf(self.ca, "client.pem")
        past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
        self.expired = self._leaf(self.ca, "expired.pem", not_before=past - datetime.timedelta(days=30), not_after=past)
        self.stranger = self._leaf(self.other_ca, "stranger.pem")

    def _write(self, name: str, blob) -> str:
        path = str(self.root / name)
        blob.write_to_path(path)
        return path

    def _leaf(self, ca, name: str, **kw) -> str:
        return self._write(name, ca.issue_cert("127.0.0.1", "localhost", **kw).private_key_and_cert_chain_pem)

    def client_tls(self, cert: str | None = None, ca: str | None = None) -> ClientTls:
        return ClientTls(ca or self.ca_file, cert, cert)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certs(tmp_path_factory.mktemp("certs"))


class TlsServed:
    """A router whose gRPC port speaks TLS, and the HTTPS front calling it over its Unix socket, as `serve` runs them."""

    def __init__(self, engine: Engine, tls: ServerTls) -> None:
        self.router = RouterThread(engine, tls=tls)
        self.http = start_http("127.0.0.1", 0, lambda: Ready(True, "ok\n"), None,
                               V1App(Upstream(lambda: self.router.router.loopback)), tls)
        self.grpc, self.port = f"127.0.0.1:{self.router.router.port}", self.http.server_port

    def close(self) -> None:
        self.http.shutdown()
        self.router.close()


def refusals() -> float:
    return sum(s.value for s in HANDSHAKE_FAILURES.collect()[0].samples if s.name.endswith("_total"))


def https_get(port: int, tls: ClientTls | None) -> int:
    ctx = tls.ssl_context() if tls else ssl.create_default_context()
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx, timeout=10) as r:
        return r.status


def grpc_model(address: str, tls: ClientTls | None) -> str:
    with secure_channel(address, tls) as channel:
        return api_grpc.GenerationStub(channel).ModelInfo(api_pb2.ModelInfoRequest(), timeout=10).target


def test_https_and_grpc_over_tls_serve_the_openai_client_and_the_stubs(tiny_models, certs, prompts, references, caplog):
    served = TlsServed(Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2),
                       ServerTls(certs.server, certs.server))
    caplog.set_level(logging.WARNING, logger="blockspec.common.wire.tls")
    try:
        client = openai.OpenAI(base_url=f"https://localhost:{served.port}/v1", api_key="x", max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=certs.client_tls().ssl_context()))
        model = client.models.list().data[0].id
        answer = client.completions.create(model=model, prompt=prompts[3], max_tokens=12, temperature=0)
        assert answer.usage.completion_tokens >= 1
        with secure_channel(served.grpc, certs.client_tls()) as channel:
            stream = api_grpc.GenerationStub(channel).Generate(
                api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=12), timeout=60)
            ids = [t for message in stream for t in message.token_ids]
        assert ids == references["qwen3"][3][:12]
        assert_clients_speak_tls(served, certs.client_tls(), model)

        before = refusals()
        with pytest.raises(http.client.RemoteDisconnected):  # plaintext to the TLS port: the handshake fails
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
            conn.request("GET", "/health")
            conn.getresponse()
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # the client trusts another CA
            https_get(served.port, ClientTls(certs._write("other-ca.pem", certs.other_ca.cert_pem)))
        assert wait_for(lambda: refusals() == before + 2)
        assert "HTTP: TLS handshake from 127.0.0.1:" in caplog.text and "HTTP_REQUEST" in caplog.text
        with pytest.raises(grpc.RpcError) as plain:
            grpc_model(served.grpc, None)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        served.close()


def assert_clients_speak_tls(served: TlsServed, tls: ClientTls, model: str) -> None:
    """The CLI's clients with their TLS flags' ClientTls: batch's request, validate's HTTP and gRPC, bench's runner."""
    from blockspec.services.bench.server import run_server_mode
    from blockspec.services.cli.batch import Job, post
    from blockspec.services.serving.golive import Client

    status, body = post(f"127.0.0.1:{served.port}", Job("a", "/v1/completions", {"model": model, "prompt": "hi",
                                                                                 "max_tokens": 2}), None, 60, tls)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    client = Client(tls)
    assert client.get(f"127.0.0.1:{served.port}", "/health") == (200, "ok\n")
    with client.channel(served.grpc) as channel:
        assert api_grpc.GenerationStub(channel).ModelInfo(api_pb2.ModelInfoRequest(), timeout=10).target == model
    row, outputs = run_server_mode(served.grpc, 0, [[5, 6, 7]], 3, 1, connect=client.channel)
    assert len(outputs) == 1 and row.tokens >= 1


def test_mutual_tls_refuses_no_an_expired_or_an_unknown_client_certificate(tiny_models, certs, caplog):
    served = TlsServed(Engine(tiny_models["qwen3"]["target"], None, "none", max_batch=1),
                       ServerTls(certs.server, certs.server, client_ca_file=certs.ca_file))
    caplog.set_level(logging.WARNING, logger="blockspec.common.wire.tls")
    try:
        assert https_get(served.port, certs.client_tls(certs.client)) == 200
        assert grpc_model(served.grpc, certs.client_tls(certs.client)) == grpc_model(served.grpc, certs.client_tls(
            certs.client))
        before = refusals()
        for cert in (None, certs.expired, certs.stranger):
            with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
                https_get(served.port, certs.client_tls(cert))
            with pytest.raises(grpc.RpcError) as refused:
                grpc_model(served.grpc, certs.client_tls(cert))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert wait_for(lambda: refusals() == before + 3)
        reasons = {s.labels["reason"] for s in HANDSHAKE_FAILURES.collect()[0].samples}
        assert {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_VERIFY_FAILED"} <= reasons, reasons
        assert https_get(served.port, certs.client_tls(certs.client)) == 200  # the server goes on
    finally:
        served.close()


def test_certificates_rotated_while_a_stream_runs(tiny_models, certs, prompts, tmp_path):
    """The files replaced mid-stream (a new CA's certificate): the stream finishes on its connection; the next HTTPS
    and gRPC connections present the new certificate (the old CA no longer verifies them, the new one does)."""
    cert = tmp_path / "live.pem"
    shutil.copy(certs.server, cert)
    served = TlsServed(Engine(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", max_batch=2),
                       ServerTls(str(cert), str(cert)))
    new_ca = trustme.CA()
    new_ca_file = certs._write("new-ca.pem", new_ca.cert_pem)
    try:
        model = grpc_model(served.grpc, certs.client_tls())
        conn = http.client.HTTPSConnection("127.0.0.1", served.port, timeout=60,
                                           context=certs.client_tls().ssl_context())
        body = {"model": model, "prompt": prompts[2], "max_tokens": 200, "temperature": 0, "stream": True,
                "num_speculative_tokens": 1}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        first = response.readline()
        assert first.startswith(b"data: {")

        rotated = tmp_path / "rotated.pem"
        new_ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(rotated))
        os.replace(rotated, cert)  # as cert-manager and certbot do: a rename over the file
        time.sleep(1.1)  # the files are looked at once a second

        rest = response.read()
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"finish_reason": "length"' in rest
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            https_get(served.port, certs.client_tls())
        assert https_get(served.port, ClientTls(new_ca_file)) == 200
        assert grpc_model(served.grpc, ClientTls(new_ca_file)) == model
        with pytest.raises(grpc.RpcError):
            grpc_model(served.grpc, certs.client_tls())
    finally:
        served.close()


def test_serve_with_tls_and_role_hops_over_tcp_under_mutual_tls(tiny_models, dflash_drafters, certs, tmp_path,
                                                                prompts, references):
    """`serve` from a config with server.tls (mutual) and server.role_tls, the roles on TCP (unix_sockets false):
    `generate --server` with the CA and a client certificate streams the target alone's tokens; the role ports
    refuse a caller without the roles' certificate."""
    from tests.helpers import CONFIG

    cfg = tmp_path / "config.yaml"
    text = CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
    text = text.replace("server:\n", f"""server:
  unix_sockets: false
  tls: {{cert_file: "{certs.server}", key_file: "{certs.server}", client_ca_file: "{certs.ca_file}"}}
  role_tls: {{cert_file: "{certs.client}", key_file: "{certs.client}", ca_file: "{certs.ca_file}"}}
""", 1)
    cfg.write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(cfg), "--no-ray"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ports = {}
        for line in proc.stdout:
            if line.startswith("SERVING "):
                ports = dict(part.split("=") for part in line.split()[1:])
                break
        assert ports, f"serve exited with code {proc.wait()}"
        tls = certs.client_tls(certs.client)
        with secure_channel(f"127.0.0.1:{ports['grpc']}", tls) as channel:
            stream = api_grpc.GenerationStub(channel).Generate(
                api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[5]), max_tokens=16), timeout=120)
            assert [t for message in stream for t in message.token_ids] == references["qwen3"][5][:16]
        out = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "generate", "--server",
                              f"127.0.0.1:{ports['grpc']}", "--tls-ca", certs.ca_file, "--tls-cert", certs.client,
                              "def add", "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["token_ids"], out.stderr
        assert https_get(int(ports["http"]), certs.client_tls(certs.client)) == 200

        import psutil

        role_ports = [c.laddr.port for child in psutil.Process(proc.pid).children()
                      for c in child.net_connections("tcp") if c.status == "LISTEN"]
        assert role_ports, "the roles listen on TCP"
        for port in role_ports:
            with pytest.raises(grpc.RpcError) as refused:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                with secure_channel(f"127.0.0.1:{port}", certs.client_tls(certs.stranger)) as channel:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # listening: the refusal above is the handshake's
    finally:
        proc.terminate()
        proc.wait(30)
