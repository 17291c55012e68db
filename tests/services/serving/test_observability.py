"""Observability against real receivers: a `blockspec serve --no-ray` exporting spans to an OTLP gRPC
receiver (the opentelemetry-proto service) and scraped by Debian's real `prometheus`."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from blockspec.common.telemetry import tracing
from blockspec.protos import api_pb2
from tests.helpers import CONFIG, collect, metric, spawn_serve, stop_serve


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver keeping (service.name, span) pairs."""

    def __init__(self) -> None:
        self.spans: list = []

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            self.spans += [(service, span) for ss in rs.scope_spans for span in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text: str, name: str, labels: str = "") -> float:
    return metric(text, name, labels) or 0.0


@pytest.fixture(scope="module")
def traced_server(tiny_models, dflash_drafters, tmp_path_factory):
    receiver = Receiver()
    otlp = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, otlp)
    otlp_port = otlp.add_insecure_port("127.0.0.1:0")
    otlp.start()
    cfg = tmp_path_factory.mktemp("obs") / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"]))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    info = spawn_serve("--config", str(cfg), "--no-ray", env=env)
    info["receiver"] = receiver
    yield info
    stop_serve(info)
    otlp.stop(0)


def generate(info, prompt_ids, max_tokens=40, request_id=""):
    req = api_pb2.GenerateRequest(request_id=request_id, token_ids=api_pb2.TokenIds(ids=prompt_ids), max_tokens=max_tokens,
                                  num_speculative_tokens=5)
    return collect(info["stub"].Generate(req, timeout=120))


def test_a_generation_is_one_trace_across_router_and_roles(traced_server, prompts):
    _, _, finish = generate(traced_server, prompts[5], request_id="traced-1")
    steps = finish.acceptance.steps
    assert steps > 0
    deadline = time.monotonic() + 30
    while True:
        spans = list(traced_server["receiver"].spans)
        request = [s for svc, s in spans if s.name == tracing.SPAN_REQUEST and attrs(s).get(tracing.ATTR_REQUEST_ID) == "traced-1"]
        if request:
            trace_id = request[0].trace_id
            in_trace = [(svc, s) for svc, s in spans if s.trace_id == trace_id]
            step_spans = [s for _, s in in_trace if s.name == tracing.SPAN_STEP]
            roles = {svc for svc, s in in_trace if s.name in (tracing.SPAN_VERIFIER_OP, tracing.SPAN_DRAFTER_OP)}
            if len(step_spans) >= steps and roles == {"blockspec-verifier", "blockspec-drafter"}:
                break
        assert time.monotonic() < deadline, f"spans seen: {sorted({(svc, s.name) for svc, s in spans})}"
        time.sleep(0.2)
    a = attrs(request[0])
    assert a[tracing.ATTR_FINISH_REASON] == "length" and a[tracing.ATTR_ACCEPTED] == finish.acceptance.accepted
    assert a[tracing.ATTR_DRAFTED] == finish.acceptance.drafted and tracing.ATTR_TTFT_S in a
    assert len(step_spans) == steps, "one step span per speculative step"
    step_ids = {s.span_id for s in step_spans}
    for s in step_spans:
        sa = attrs(s)
        assert {tracing.ATTR_K, tracing.ATTR_DRAFTED, tracing.ATTR_ACCEPTED, tracing.ATTR_TAU, tracing.ATTR_BATCH_SIZE,
                tracing.ATTR_DRAFT_S, tracing.ATTR_VERIFY_S, tracing.ATTR_FALLBACK} <= set(sa)
        assert sa[tracing.ATTR_BATCH_SIZE] == 1 and sa[tracing.ATTR_FALLBACK] is False
        assert request[0].span_id in {link.span_id for link in s.links}, "a step links the requests it served"
    assert sum(attrs(s)[tracing.ATTR_ACCEPTED] for s in step_spans) == finish.acceptance.accepted
    role_spans = [(svc, s) for svc, s in in_trace if svc != "blockspec-router"]
    assert all(s.parent_span_id in step_ids for _, s in role_spans), "role spans are children of the router's step"


def test_acceptance_summary_matches_the_counters(traced_server, prompts):
    before = metrics_text(traced_server["http"])
    _, _, finish = generate(traced_server, prompts[4], max_tokens=48)
    after = metrics_text(traced_server["http"])
    a = finish.acceptance

    def delta(name, labels=""):
        return sample(after, name, labels) - sample(before, name, labels)

    assert delta("blockspec_spec_decode_num_draft_tokens_total") == a.drafted > 0
    assert delta("blockspec_spec_decode_num_accepted_tokens_total") == a.accepted
    for pos, n in enumerate(a.accepted_per_pos):
        assert delta("blockspec_spec_decode_num_accepted_tokens_per_pos_total", f'{{position="{pos}"}}') == n
    assert delta("blockspec_generation_tokens_total") == finish.usage.completion_tokens
    assert delta("blockspec_time_to_first_token_seconds_count") == 1
    assert delta("blockspec_requests_finished_total", '{reason="length"}') == 1
    assert sample(after, "blockspec_role_memory_bytes", '{kind="rss",replica="0",role="verifier"}') > 0
    assert sample(after, "blockspec_role_memory_bytes", '{kind="rss",replica="0",role="drafter"}') > 0


def test_errors_are_counted_by_status_code(traced_server):
    before = sample(metrics_text(traced_server["http"]), "blockspec_request_errors_total", '{code="INVALID_ARGUMENT"}')
    with pytest.raises(grpc.RpcError):
        list(traced_server["stub"].Generate(api_pb2.GenerateRequest(text="", max_tokens=4), timeout=30))
    after = sample(metrics_text(traced_server["http"]), "blockspec_request_errors_total", '{code="INVALID_ARGUMENT"}')
    assert after == before + 1


def test_real_prometheus_scrapes_acceptance_and_latency(traced_server, prompts, tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (.ci/run installs Debian's package)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: blockspec\n"
                      f"    static_configs:\n      - targets: ['127.0.0.1:{traced_server['http']}']\n")
    proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for i in range(3):
            generate(traced_server, prompts[i + 2], max_tokens=32)

        def query(q: str) -> list:
            url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(q)}"
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())["data"]["result"]

        queries = {
            "accepted": "blockspec_spec_decode_num_accepted_tokens_total",
            "acceptance": "blockspec_spec_decode_acceptance_rate",
            "ttft_count": "blockspec_time_to_first_token_seconds_count",
            "itl_p99": "histogram_quantile(0.99, sum by (le) (blockspec_inter_token_latency_seconds_bucket))",
        }
        deadline, got = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            try:
                got = {k: query(q) for k, q in queries.items()}
            except OSError:  # prometheus still starting
                got = {}
            if got and all(got.values()) and float(got["ttft_count"][0]["value"][1]) >= 3:
                break
            time.sleep(0.5)
        assert got and all(got.values()), f"prometheus returned {got}"
        assert float(got["accepted"][0]["value"][1]) > 0
        assert 0 < float(got["acceptance"][0]["value"][1]) <= 1
        assert float(got["itl_p99"][0]["value"][1]) > 0
    finally:
        proc.terminate()
        proc.wait(30)
