"""`blockspec validate --server HOST:PORT | --config C`: the go-live checks of a served pair, in order - ready,
identity, ratio, acceptance, latency, memory per role, tokenizer alignment - as a table or one JSON object; exit
code 1 with a line naming each failed check."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from blockspec.common.argtypes import address, bounded
from blockspec.common.errors import InvalidArgument
from blockspec.services.cli.args import add_tls_client_args, client_tls, read_prompts
from blockspec.services.cli.ports import GRPC, HTTP, check_speaks
from blockspec.services.serving.golive import ACCEPTANCE_ALERT, DEFAULT_MIN_RATIO, Bounds, run_checks


def add_validate_command(sub) -> None:
    from blockspec.services.training.default_pair import default_home

    v = sub.add_parser("validate", help="go-live checks of a served pair: ready, identity, ratio, acceptance, "
                                        "latency, memory, tokenizer")
    where = v.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", type=address, help="HOST:PORT of a running server's gRPC API (server.grpc_port)")
    where.add_argument("--config", help="a server config: serve it in one process for the run (ports chosen free)")
    v.add_argument("--http", type=address, help="with --server: HOST:PORT of its HTTP port (server.port; /health's "
                                                "reason, /metrics' memory per role)")
    v.add_argument("--reference", type=address, help="HOST:PORT of the gRPC API of a server whose plain decoding the "
                   "identity check compares with (default: the validated server at num_speculative_tokens 0)")
    v.add_argument("--prompts-file", default=str(default_home() / "base" / "heldout_prompts.jsonl"),
                   help="one prompt a line (.jsonl: a JSON string each; default: the shipped pair's held-out prompts)")
    v.add_argument("--num-prompts", type=bounded(1), help="use the first N prompts")
    v.add_argument("--max-tokens", type=bounded(1), default=128, help="new tokens per request (default 128)")
    v.add_argument("--rounds", type=bounded(1), default=3, help="timed passes of each k, interleaved; the median "
                                                                "pass is reported (default 3)")
    v.add_argument("--min-ratio", type=_positive, default=DEFAULT_MIN_RATIO,
                   help=f"speculative over plain tokens/s at concurrency 1 (default {DEFAULT_MIN_RATIO})")
    v.add_argument("--min-acceptance", type=_share, default=ACCEPTANCE_ALERT,
                   help=f"accepted / drafted tokens (default {ACCEPTANCE_ALERT}, the alert rule's floor)")
    v.add_argument("--max-ttft-ms", type=_positive, help="p99 time to first token: a check when given")
    v.add_argument("--max-itl-ms", type=_positive, help="p99 inter-token latency: a check when given")
    v.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    add_tls_client_args(v)
    v.set_defaults(func=cmd_validate)


def _positive(value: str) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number > 0")
    return number


def _share(value: str) -> float:
    number = float(value)
    if not 0 < number <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a share in (0, 1]")
    return number


def cmd_validate(args: argparse.Namespace) -> int:
    if args.config is not None and args.http is not None:
        raise InvalidArgument("--http", "goes with --server (--config serves its own HTTP port)")
    texts = read_prompts(None, args.prompts_file)[: args.num_prompts]
    tls = client_tls(args)
    if args.config is None:
        if args.http is not None:
            check_speaks("--http", args.http, HTTP, tls)
        result = run_checks(args.server, args.http, texts, bounds(args), tls)
        if _failed(result, "ready"):  # the HTTP port, perhaps: refused naming it
            check_speaks("--server", args.server, GRPC, tls)
    else:
        from blockspec.services.cli.local_server import served

        with served(args.config) as server:
            result = run_checks(server.grpc, server.http, texts, bounds(args), tls)
    if args.reference is not None and _failed(result, "identity"):
        check_speaks("--reference", args.reference, GRPC, tls)
    return report(args, result)


def _failed(result: dict, check: str) -> bool:
    return any(c.name == check and c.status == "fail" for c in result["checks"])


def bounds(args: argparse.Namespace) -> Bounds:
    return Bounds(args.max_tokens, args.rounds, args.min_ratio, args.min_acceptance, args.max_ttft_ms, args.max_itl_ms,
                  args.reference)


def report(args: argparse.Namespace, result: dict) -> int:
    """Print the table (or --json) on stdout, a line per failed check on stderr -> the exit code."""
    checks = result["checks"]
    failed = [c for c in checks if c.status == "fail"]
    result = {**result, "checks": [asdict(c) for c in checks], "passed": not failed}
    print(json.dumps(result, indent=1) if args.json else table(result))
    for c in failed:
        print(f"blockspec: validate: {c.name} failed: {c.detail}", file=sys.stderr)
    return 1 if failed else 0


def table(result: dict) -> str:
    model = result.get("model") or {}
    about = f" (target {model['target']}, {model['method']} k={model['k']})" if model else ""
    run = (f"{result['prompts']} prompts x {result['max_tokens']} tokens, greedy, concurrency 1, "
           f"{result['rounds']} timed passes of each k")
    lines = [f"server {result['server']}{about}", run, "", f"{'check':<11} {'result':<6} detail"]
    lines += [f"{c['name']:<11} {c['status']:<6} {c['detail']}" for c in result["checks"]]
    failed = [c["name"] for c in result["checks"] if c["status"] == "fail"]
    lines += ["", f"FAILED: {', '.join(failed)}" if failed else "all checks pass"]
    return "\n".join(lines)
