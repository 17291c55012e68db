"""A soak of a running server's gRPC API: N streams at once, each sending one request after another for a while; prints
one JSON line with tokens/s, latency percentiles and how many outputs differ from plain decoding on the same server.

    python benchmarks/soak.py --grpc 127.0.0.1:8001 --streams 64 --seconds 120

The prompts are the shipped pair's held-out ones, greedy, max_tokens 128 (`--max-tokens`), the server's default k.
Each prompt's plain decoding (k = 0) is asked first, one at a time; a speculative output that differs is a mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import grpc

from blockspec.protos import api_grpc, api_pb2

PROMPTS = Path(__file__).resolve().parents[1] / "models" / "base" / "heldout_prompts.jsonl"


async def generate(stub, text: str, max_tokens: int, k: int | None) -> tuple[list[int], float]:
    request = api_pb2.GenerateRequest(text=text, max_tokens=max_tokens)
    if k is not None:
        request.num_speculative_tokens = k
    started, ids = time.monotonic(), []
    async for message in stub.Generate(request, timeout=600):
        ids.extend(message.token_ids)
    return ids, time.monotonic() - started


async def soak(address: str, streams: int, seconds: float, max_tokens: int) -> dict:
    texts = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.GenerationStub(channel)
        plain = [(await generate(stub, t, max_tokens, 0))[0] for t in texts]
        latencies: list[float] = []
        tokens, mismatches = 0, 0
        end = time.monotonic() + seconds

        async def client(i: int) -> None:
            nonlocal tokens, mismatches
            n = 0
            while time.monotonic() < end:
                p = (i + n) % len(texts)
                ids, took = await generate(stub, texts[p], max_tokens, None)
                latencies.append(took)
                tokens += len(ids)
                mismatches += ids != plain[p]
                n += 1

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(streams)))
        elapsed = time.monotonic() - started
    cuts = statistics.quantiles(latencies, n=20)
    return {"streams": streams, "seconds": round(elapsed, 1), "requests": len(latencies), "tokens": tokens,
            "tokens_per_s": round(tokens / elapsed, 1), "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p95_s": round(cuts[18], 3), "mismatches": mismatches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", default="127.0.0.1:8001", help="the server's gRPC address")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(soak(args.grpc, args.streams, args.seconds, args.max_tokens))))


if __name__ == "__main__":
    main()
