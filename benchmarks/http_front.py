"""Probe a running server's HTTP port as a hostile client and a load test do: /health under N simultaneous
connections, clients that trickle header bytes, a stalled body, header bytes that are not printable ASCII, and /v1
completion throughput at concurrency 1 and 8. Prints one JSON object.

    python benchmarks/http_front.py --http 127.0.0.1:8000 [--model ID] [--requests 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor


async def _health(host: str, port: int) -> tuple[float, bool]:
    """(seconds, answered 200)."""
    started = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        ok = (await reader.read()).split(b" ", 2)[1:2] in ([b"200"], [b"503"])  # answered
        writer.close()
    except OSError:
        ok = False
    return time.monotonic() - started, ok


async def health_burst(host: str, port: int, n: int) -> dict:
    answers = await asyncio.gather(*(_health(host, port) for _ in range(n)))
    times = sorted(t for t, _ in answers)
    return {"connections": n, "failed": sum(not ok for _, ok in answers), "p50_ms": round(times[n // 2] * 1000, 1),
            "p99_ms": round(times[int(n * 0.99)] * 1000, 1), "max_ms": round(times[-1] * 1000, 1),
            "over_100ms": sum(t > 0.1 for t in times)}


async def _trickle(host: str, port: int, seconds: float) -> bool:
    """True if the server still holds the connection after `seconds` of one header byte a second."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /health HTTP/1.1\r\n")
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            writer.write(b"X")
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    return False
            except TimeoutError:
                pass
        return True
    except ConnectionError:
        return False
    finally:
        writer.close()


async def trickle(host: str, port: int, n: int, seconds: float) -> dict:
    held = await asyncio.gather(*(_trickle(host, port, seconds) for _ in range(n)))
    return {"connections": n, "after_s": seconds, "still_open": sum(held)}


def raw(host: str, port: int, data: bytes, timeout: float = 60.0) -> tuple[str, float]:
    import socket

    started = time.monotonic()
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        try:
            reply = s.recv(4096)
        except TimeoutError:
            reply = b"(no answer)"
    return reply.split(b"\r\n", 1)[0].decode("latin-1"), round(time.monotonic() - started, 2)


def completions(host: str, port: int, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": max_tokens, "temperature": 0})

    def one(_) -> int:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        conn.close()
        return answer["usage"]["completion_tokens"]

    one(0)  # warm
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(requests)))
    seconds = time.monotonic() - started
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True, help="HOST:PORT")
    ap.add_argument("--model", help="the served model id (default: GET /v1/models)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--trickle-s", type=float, default=30.0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-probes", action="store_true", help="throughput only")
    args = ap.parse_args()
    host, port = args.http.rsplit(":", 1)
    port = int(port)
    out: dict = {} if args.skip_probes else probes(host, port, args.trickle_s)
    if not args.skip_throughput:
        model = args.model
        if model is None:
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request("GET", "/v1/models")
            model = json.loads(conn.getresponse().read())["data"][0]["id"]
        out["throughput"] = [completions(host, port, model, c, args.requests, args.max_tokens) for c in (1, 8)]
    print(json.dumps(out, indent=1))


def probes(host: str, port: int, trickle_s: float) -> dict:
    out: dict = {"health_50": asyncio.run(health_burst(host, port, 50)),
                 "health_200": asyncio.run(health_burst(host, port, 200))}
    out["trickle"] = asyncio.run(trickle(host, port, 50, trickle_s))
    body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    out["stalled_body"] = raw(host, port, body)
    for name, value in (("non_ascii_authorization", b"Authorization: Bearer caf\xc3\xa9"),
                        ("control_x_request_id", b"X-Request-Id: a\x01b"), ("non_ascii_x_request_id", b"X-Request-Id: a\xe9")):
        payload = b'{"prompt": "hi", "max_tokens": 2}'
        out[name] = raw(host, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        + value + b"\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return out


if __name__ == "__main__":
    main()
