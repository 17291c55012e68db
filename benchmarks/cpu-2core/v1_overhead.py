"""Concurrency 1 on the served default pair (deploy/config.yaml, `serve --no-ray`): the held-out prompts x 128 tokens
through gRPC `Generate`, through `/v1/completions` streamed by the OpenAI client, and through `/v1/completions` read
as raw server-sent events (http.client; only the last chunk, with the usage, is parsed), in rounds that rotate
their order. The raw reader separates the server's own /v1 cost from the OpenAI client's parsing, which shares
the machine's cores with the server.
Usage: .venv/bin/python benchmarks/cpu-2core/v1_overhead.py [ROUNDS]"""

import json
import re
import signal
import statistics
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path

import grpc
import openai

from blockspec.protos import api_grpc, api_pb2

ROOT = Path(__file__).resolve().parents[2]  # the repository
PROMPTS = [json.loads(line) for line in (ROOT / "models/base/heldout_prompts.jsonl").read_text().splitlines() if line]


def start() -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([str(ROOT / ".venv/bin/blockspec"), "serve", "--config", "deploy/config.yaml", "--no-ray",
                             "--port", "0", "--grpc-port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if m := re.match(r"SERVING grpc=(\d+) http=(\d+)", line):
            return proc, int(m[1]), int(m[2])
    raise SystemExit("serve did not start")


def raw_sse(conn: HTTPConnection, model: str) -> int:
    """The prompts through /v1/completions, each stream read line by line; only its usage chunk is parsed."""
    tokens = 0
    for p in PROMPTS:
        body = {"model": model, "prompt": p, "max_tokens": 128, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        last = b""
        for line in conn.getresponse():  # the usage chunk is the last data line before [DONE]
            last = line if line.startswith(b"data: {") else last
        tokens += json.loads(last.removeprefix(b"data: "))["usage"]["completion_tokens"]
    return tokens


def main(rounds: int) -> None:
    proc, grpc_port, http_port = start()
    stub = api_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id

    def via_grpc() -> int:
        return sum(len(m.token_ids) for p in PROMPTS for m in stub.Generate(api_pb2.GenerateRequest(text=p, max_tokens=128)))

    def via_http() -> int:
        return sum(c.usage.completion_tokens for p in PROMPTS
                   for c in client.completions.create(model=model, prompt=p, max_tokens=128, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}) if c.usage)

    raw = HTTPConnection("127.0.0.1", http_port)
    ways = {"grpc": via_grpc, "http": via_http, "http-raw": lambda: raw_sse(raw, model)}
    for way in ways.values():  # warm
        way()
    rates: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                started = time.perf_counter()
                tokens = ways[name]()
                rates[name].append(tokens / (time.perf_counter() - started))
                print(name, tokens, f"{rates[name][-1]:.1f} tokens/s", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    for name, values in rates.items():
        print(name, "median", f"{statistics.median(values):.1f}", "all", [f"{v:.1f}" for v in sorted(values)])


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
