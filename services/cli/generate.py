"""`blockspec generate`: generate in this process (the in-process engine) or through a running server's gRPC API,
stream the text and print tau, acceptance and speed."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from blockspec.common.argtypes import address, bounded, draft_tree
from blockspec.common.config import DEFAULT_K, MAX_BATCH, MAX_LOOKUP_TOKENS, MIN_MODEL_LEN
from blockspec.common.errors import InvalidArgument
from blockspec.common.runtime.device import add_device_args
from blockspec.common.runtime.device import resolve as resolve_device
from blockspec.common.sampling import RULES, SamplingParams
from blockspec.common.tokens.detokenize import TextStream
from blockspec.services.cli.args import (
    UINT32,
    UINT64,
    add_tls_client_args,
    as_flag,
    client_tls,
    read_prompts,
    seconds,
    threads,
)
from blockspec.services.cli.ports import GRPC, check_speaks
from blockspec.services.drafter.proposers import MAX_K, METHODS, default_method
from blockspec.services.router.step_loop import FinishEvent, RequestStats, TokenEvent
from blockspec.services.router.stops import StopMatcher
from blockspec.services.router.validation import validate_stops


def add_generate_command(sub) -> None:
    """Register `generate` on the CLI's subparsers."""
    gen = sub.add_parser("generate", help="generate in this process and stream the text")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompts-file", help="one prompt per line (.jsonl: one JSON string per line); all run "
                     "concurrently in batched steps")
    gen.add_argument("--target", help="target checkpoint directory (HF layout)")
    gen.add_argument("--server", type=address, help="HOST:PORT of a running server's gRPC API (server.grpc_port): "
                     "generate through it")
    gen.add_argument("--timeout", type=seconds, default=600, help="--server: deadline per request in seconds")
    add_tls_client_args(gen)
    gen.add_argument("--drafter", help="drafter checkpoint directory (draft_model, dflash)")
    gen.add_argument("--method", choices=METHODS, help="drafting method (default: dflash for a DFlash drafter, draft_model for another, else ngram)")
    gen.add_argument("-k", type=bounded(0, UINT32), help=f"draft tokens per step, 0..{MAX_K} (0: plain decoding; dflash: "
                     f"up to block_size-1; default {DEFAULT_K})")
    gen.add_argument("--max-tokens", type=bounded(1, UINT32), default=128, help="new tokens per prompt (default 128)")
    gen.add_argument("--stop", action="append", help="stop sequence (text; repeatable): the output ends before it")
    samp = gen.add_argument_group("sampling (defaults: greedy; docs/sampling.md)")
    samp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=bounded(0, UINT32), default=0, help="0 = off")
    samp.add_argument("--seed", type=bounded(0, UINT64), help="same seed -> same text (rule strict: with or without speculation)")
    samp.add_argument("--rule", choices=RULES, default="rejection", help="verification rule when sampling")
    samp.add_argument("--repetition-penalty", type=float, default=1.0, help="HF semantics over prompt + output; 1 = off")
    samp.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI semantics over the output")
    samp.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI semantics over the output")
    samp.add_argument("--no-repeat-ngram-size", type=bounded(0, UINT32), default=0, help="ban repeating an n-gram of prompt + output")
    samp.add_argument("--logit-bias", action="append", metavar="TOKEN_ID=BIAS", help="add BIAS to a token's logit (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    gen.add_argument("--max-batch", type=bounded(1, MAX_BATCH), default=16, help="requests stepped together (default 16)")
    gen.add_argument("--max-model-len", type=bounded(MIN_MODEL_LEN), help="KV cache length per request (default: model context, <= 4096)")
    gen.add_argument("--invariant", action="store_true", help="decode with the verify query width (docs/exactness.md)")
    gen.add_argument("--runner", choices=("auto", "eager", "graphs"), default="auto",
                     help="the target's runner (auto: the CUDA runner's captured steps where it applies; docs/gpu.md)")
    gen.add_argument("--no-dynamic-conv", action="store_true", help="dflash ablation: identity convolutions")
    gen.add_argument("--no-path-selector", action="store_true", help="dflash ablation: per-slot argmax")
    gen.add_argument("--threads", type=threads, help="CPU threads (default: one per core that other processes leave "
                     "free, followed as their load changes)")
    gen.add_argument("--draft-tree", type=draft_tree, default=(), metavar="N[,N...]",
                     help="dflash: draft a tree, N children per node at each depth (1 past the list; e.g. 3 or 2,2), "
                          "verified in one forward (docs/sampling.md#draft-trees)")
    gen.add_argument("--adaptive-k", action="store_true", help="choose k <= K per request per step (0 when drafting does not pay)")
    gen.add_argument("--prompt-lookup", action="store_true",
                     help="draft a repeat of the context by n-gram lookup; the drafter drafts the other requests")
    gen.add_argument("--prompt-lookup-tokens", type=bounded(1, MAX_LOOKUP_TOKENS),
                     help="with --prompt-lookup: a lookup's draft tokens when one request runs (default: k)")
    add_device_args(gen)
    gen.set_defaults(func=cmd_generate)


def stats_dict(stats: RequestStats, num_tokens: int) -> dict:
    return {
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tau": round(stats.tau, 4),
        "acceptance_rate": None if stats.acceptance_rate is None else round(stats.acceptance_rate, 4),
        "accepted_per_pos": list(stats.accepted_per_pos),
        "tokens_per_s": round(num_tokens / stats.elapsed_s, 2) if stats.elapsed_s else 0.0,
        "elapsed_s": round(stats.elapsed_s, 4),
        "ttft_s": round(stats.first_token_s, 4),  # from submission: a prompt waiting for a slot waits here too
    }


def stats_line(s: dict) -> str:
    rate = "n/a (nothing drafted)" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"
    return (
        f"tau {s['tau']:.2f} tokens/step | acceptance rate {rate} ({s['accepted']}/{s['drafted']}) | "
        f"accepted per position {s['accepted_per_pos']} | {s['tokens_per_s']:.1f} tokens/s "
        f"({s['steps']} steps, {s['elapsed_s']:.2f} s) | TTFT {s['ttft_s'] * 1e3:.1f} ms"
    )


def _check_utf8(field: str, texts: list[str]) -> None:
    """Text from the command line is UTF-8 (bytes that are not reach Python as lone surrogates)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(field, f"not UTF-8 text (character {e.start})") from None


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams (validated by the engine or the server)."""
    bias = []
    for item in args.logit_bias or []:
        token, _, value = item.partition("=")
        try:
            bias.append((int(token), float(value)))
        except ValueError:
            raise InvalidArgument("--logit-bias", f"expected TOKEN_ID=BIAS, got {item!r}") from None
        if bias[-1][0] in dict(bias[:-1]):  # a map on the wire: one bias per token
            raise InvalidArgument("--logit-bias", f"token {bias[-1][0]} is given twice")
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, rule=args.rule,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        logit_bias=tuple(sorted(dict(bias).items())))


def generate_remote(args: argparse.Namespace, prompts: list[str]) -> int:
    """`generate --server`: the same output through the public gRPC API and its generated stubs."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from blockspec.common.wire.auth import client_channel
    from blockspec.protos import api_grpc, api_pb2

    tls = client_tls(args)
    channel = client_channel(args.server, tls=tls)
    stub = api_grpc.GenerationStub(channel)
    stream_text = not args.json and len(prompts) == 1

    from blockspec.common.sampling import fill_pb

    sampling = _sampling(args)

    def one(prompt: str) -> dict:
        req = api_pb2.GenerateRequest(text=prompt, max_tokens=args.max_tokens, stop=args.stop or [])
        fill_pb(sampling, req.sampling)
        if args.k is not None:
            req.num_speculative_tokens = args.k
        started, ids, text, finish, first = time.perf_counter(), [], "", None, None
        for msg in stub.Generate(req, timeout=args.timeout):
            if msg.token_ids and first is None:
                first = time.perf_counter() - started
            ids += msg.token_ids
            text += msg.text
            if stream_text:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
            if msg.HasField("finish"):
                finish = msg.finish
        elapsed, a = time.perf_counter() - started, finish.acceptance
        return {"text": text, "token_ids": ids, "finish_reason": finish.reason, "stats": {
            "steps": a.steps, "drafted": a.drafted, "accepted": a.accepted, "tau": round(a.tau, 4),
            "acceptance_rate": round(a.acceptance_rate, 4) if a.drafted else None,
            "accepted_per_pos": list(a.accepted_per_pos), "tokens_per_s": round(len(ids) / elapsed, 2),
            "elapsed_s": round(elapsed, 4), "ttft_s": round(elapsed if first is None else first, 4)}}

    try:
        with ThreadPoolExecutor(max(1, min(len(prompts), args.max_batch))) as pool:
            results = list(pool.map(one, prompts))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # "FIELD: why" from the server: FIELD as the flag
            field, _, why = e.details().partition(": ")
            if not why or " " in field:
                field, why = "request", e.details()
            raise InvalidArgument(as_flag(field), why) from None
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # the HTTP port, perhaps: refused naming it
            check_speaks("--server", args.server, GRPC, tls)
        print(f"blockspec: error: server {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if stream_text:
        sys.stdout.write("\n")
    _print_results(args, results, stream_text)
    return 0


def total_stats(results: list[dict]) -> dict:
    """The stats of several prompts run together: sums, tokens/s over the longest elapsed time, the median TTFT."""
    stats = [r["stats"] for r in results]
    steps, drafted, accepted = (sum(s[key] for s in stats) for key in ("steps", "drafted", "accepted"))
    width = max(len(s["accepted_per_pos"]) for s in stats)
    elapsed = max(s["elapsed_s"] for s in stats)
    return {"steps": steps, "drafted": drafted, "accepted": accepted,
            "tau": round(1 + accepted / steps, 4) if steps else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "accepted_per_pos": [sum(s["accepted_per_pos"][i] for s in stats if i < len(s["accepted_per_pos"]))
                                 for i in range(width)],
            "tokens_per_s": round(sum(len(r["token_ids"]) for r in results) / elapsed, 2) if elapsed else 0.0,
            "elapsed_s": elapsed, "ttft_s": statistics.median(s["ttft_s"] for s in stats)}


def _print_results(args: argparse.Namespace, results: list[dict], streamed: bool) -> None:
    for i, result in enumerate(results):
        if args.json:
            print(json.dumps(result))
        else:
            if not streamed:
                print(f"--- prompt {i}\n{result['text']}")
            print(stats_line(result["stats"]))
    if len(results) > 1 and not args.json:
        print(f"all {len(results)} prompts: {stats_line(total_stats(results))}")


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompt, args.prompts_file)
    for field, texts in (("prompt", prompts), ("--stop", args.stop or [])):
        _check_utf8(field, texts)
    if args.server:
        if args.target or args.drafter or args.method:
            raise InvalidArgument("--server", "the server has its models: drop --target, --drafter and --method")
        return generate_remote(args, prompts)
    if not args.target:
        raise InvalidArgument("--target", "give a target checkpoint directory (or --server HOST:PORT)")
    from blockspec.services.engine.engine import Engine

    if args.prompt_lookup_tokens and not args.prompt_lookup:  # it would be ignored
        raise InvalidArgument("--prompt-lookup-tokens", "goes with --prompt-lookup")
    method = args.method or default_method(args.drafter)
    device, dtype = resolve_device(args.device, args.dtype)
    try:  # the engine's errors name its own fields: said as the flags
        engine = Engine(args.target, args.drafter, method, max_batch=min(len(prompts), args.max_batch),
                        max_len=args.max_model_len, invariant=args.invariant,
                        use_dynamic_conv=not args.no_dynamic_conv, use_path_selector=not args.no_path_selector,
                        adaptive_k=args.adaptive_k, prompt_lookup=args.prompt_lookup,
                        prompt_lookup_tokens=args.prompt_lookup_tokens, device=device, dtype=dtype,
                        threads=args.threads, backend=args.runner, draft_tree=args.draft_tree)
        # Validate every prompt before anything is generated or written.
        validate_stops(args.stop or [], "--stop")
        sampling = _sampling(args)
        requests = [engine.request(str(i), engine.encode(p), args.max_tokens, args.k, sampling)
                    for i, p in enumerate(prompts)]
    except InvalidArgument as e:
        raise InvalidArgument(as_flag(e.field), e.message) from None
    stream_text = not args.json and len(prompts) == 1
    results = _generate_texts(engine, requests, args.stop or [], sys.stdout.write if stream_text else None)
    if stream_text:
        sys.stdout.write("\n")
    _print_results(args, [results[req.request_id] for req in requests], stream_text)
    return 0


def _generate_texts(engine, requests: list, stop: list[str], write=None) -> dict[str, dict]:
    """Each request's result (text, token ids, finish reason, stats); write(delta): stream the released text. A stop
    sequence ends its request's text (and the request) wherever it completes: in a step that also finished the
    request (whose FinishEvent then follows), or in the text flushed at the finish."""
    streams = {r.request_id: (TextStream(engine.tokenizer), StopMatcher(stop)) for r in requests}
    released = {r.request_id: "" for r in requests}
    stopped: set[str] = set()  # hit a stop sequence, its finish still to come
    results: dict[str, dict] = {}
    for event in engine.generate(requests):
        rid = event.request_id
        if rid in results or (rid in stopped and isinstance(event, TokenEvent)):
            continue  # stopped by a stop sequence: its cancellation is reported, or its finish comes next
        text, stops = streams[rid]
        if isinstance(event, TokenEvent):
            delta, hit = stops.push(text.push(event.token_ids))
            if hit:  # stop generating; the text ends before the stop sequence
                stopped.add(rid)
                final = engine.loop.cancel(rid)  # None: it finished in this step
                if final is not None:
                    results[rid] = _result(final, "stop_sequence", released[rid] + delta)
        else:
            delta, hit = stops.finish(text.flush()) if rid not in stopped else ("", True)
            results[rid] = _result(event, "stop_sequence" if hit else event.reason, released[rid] + delta)
        released[rid] += delta
        if write is not None:
            write(delta)
            sys.stdout.flush()
    return results


def _result(event: FinishEvent, reason: str, text: str) -> dict:
    return {"text": text, "token_ids": list(event.token_ids), "finish_reason": reason,
            "stats": stats_dict(event.stats, len(event.token_ids))}
