"""`blockspec bench --server`: the benchmark's workload through a running server's public gRPC API (the generated
stubs, as a platform team calls it), each k's passes interleaved with plain decoding's on the same server."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc

from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.common.wire.auth import client_channel
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.bench.latency import ChunkGaps, latency
from blockspec.services.bench.modes import SERVER, Mode, Row
from blockspec.services.bench.rate import arrival_times, check_rates
from blockspec.services.bench.run import (
    accepted_per_position,
    against_plain,
    compared,
    request_sampling,
    timed_passes,
    workload,
)


class ServerStreamError(RuntimeError):
    """A server's stream that broke the API's contract (`bench --server` says so in one line, exit 1)."""


def wire_sampling(sampling: SamplingParams, i: int) -> api_pb2.SamplingParams | None:
    """Request i's sampling on the wire (`run.request_sampling`: seeded seed + i); None for greedy."""
    if sampling.greedy:
        return None
    sp = request_sampling(sampling, i)
    return api_pb2.SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed, rule=sp.rule)


def run_server_mode(address: str, k: int, prompts, max_tokens: int, concurrency: int,
                    arrivals: Sequence[float] | None = None,
                    connect: Callable[[str], grpc.Channel] = client_channel,
                    sampling: SamplingParams = GREEDY) -> tuple[Row, list]:
    """The same workload (`workload`'s requests) through a running server's gRPC API, `concurrency` streams at a
    time; with arrivals (open loop), request i is sent arrivals[i] seconds into the pass, or when a stream frees
    if all are busy then, and its TTFT counts from its arrival. connect(address): the channel to use. sampling:
    every request's, request i seeded seed + i."""
    channel = connect(address)
    stub = api_grpc.GenerationStub(channel)

    def one(i: int, p, at: float | None = None):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=p), max_tokens=max_tokens, num_speculative_tokens=k,
                                      sampling=wire_sampling(sampling, i))
        if at is not None:
            time.sleep(max(pass_started + at - time.perf_counter(), 0.0))
        ids, finish, started, first = [], None, time.perf_counter() if at is None else pass_started + at, None
        chunks = ChunkGaps()  # this stream's
        for msg in stub.Generate(req, timeout=600):
            if msg.token_ids:
                chunks.saw("")
                first = first or time.perf_counter()
            ids += msg.token_ids
            finish = msg.finish if msg.HasField("finish") else finish
        if finish is None:  # the server closed the stream cleanly without saying how the request ended
            raise ServerStreamError(f"a stream ended after {len(ids)} tokens without its finish message")
        return ids, finish.acceptance, (first or started) - started, time.perf_counter() - (first or started), chunks.gaps

    one(0, prompts[0])  # warm-up
    pass_started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(prompts)), prompts, *([arrivals] if arrivals is not None else [])))
    elapsed = time.perf_counter() - pass_started
    channel.close()
    acc = [a for _, a, *_ in results]
    steps, drafted, accepted = (sum(getattr(a, f) for a in acc) for f in ("steps", "drafted", "accepted"))
    per_pos = accepted_per_position([a.accepted_per_pos for a in acc])
    tokens = sum(len(ids) for ids, *_ in results)
    times = latency([t for *_, t, _, _ in results], [(d, max(len(ids) - 1, 0)) for ids, *_, d, _ in results],
                    [g for *_, gaps in results for g in gaps])
    return Row(SERVER.name, k, concurrency, tokens, elapsed, tokens / elapsed, tau=1 + accepted / steps if drafted else None,
               acceptance_rate=accepted / drafted if drafted else None, accepted_per_pos=per_pos.tolist(), steps=steps,
               **times), [ids for ids, *_ in results]


def server_passes(address: str, texts: Sequence[str], max_tokens: int, ks: list[int] | None, concurrency: list[int],
                  rounds: int, waves: int, rates: Sequence[float], cap: int,
                  connect: Callable[[str], grpc.Channel] = client_channel,
                  sampling: SamplingParams = GREEDY) -> tuple[list, list, list]:
    """(closed-loop rows, open-loop rows, the prompts' token ids, tokenized by the server): each k's passes interleaved
    per concurrency and rate, against k = 0's where it ran (`exact` where greedy or `strict`). ks None: 0 and the
    server's default k (ModelInfo), 0 alone without a drafter. connect(address): the channel to use."""
    with connect(address) as channel:
        stub = api_grpc.GenerationStub(channel)
        prompts = [list(stub.Tokenize(api_pb2.TokenizeRequest(text=t), timeout=60).token_ids) for t in texts]
        if ks is None:
            default_k = stub.ModelInfo(api_pb2.ModelInfoRequest(), timeout=60).default_speculative_tokens
            ks = [0, default_k] if default_k else [0]
    check_rates(rates, len(workload(prompts, cap, waves)))
    ks = sorted(set(ks))
    rows, rate_rows = [], []
    for c, rate in [(c, None) for c in concurrency] + [(cap, rate) for rate in rates]:
        work = workload(prompts, c, waves)
        arrivals = arrival_times(len(work), rate) if rate else None
        runners = {Mode(SERVER.name, k): functools.partial(run_server_mode, address, k, work, max_tokens, c, arrivals,
                                                                      connect=connect, sampling=sampling)
                   for k in ks}
        passes = timed_passes(runners, rounds)
        (rate_rows if rate else rows).extend(against_plain(passes, rate, SERVER, functools.partial(compared, sampling)))
    return rows, rate_rows, prompts
