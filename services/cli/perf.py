"""`blockspec bench` and `blockspec gpu-check`: the performance commands of the CLI."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from blockspec.common.argtypes import address, bounded
from blockspec.common.errors import InvalidArgument
from blockspec.common.runtime.device import add_device_args
from blockspec.common.runtime.device import resolve as resolve_device
from blockspec.common.sampling import RULES, SamplingParams, checked
from blockspec.services.cli.args import (
    UINT32,
    UINT64,
    add_tls_client_args,
    as_flag,
    client_tls,
    out_dir,
    read_prompts,
    set_threads,
    threads,
)
from blockspec.services.cli.ports import GRPC, check_speaks

DEFAULT_MODES = ("none,ngram:5,dflash:3,dflash:5,dflash:7,dflash:7:adaptive,dflash:7:replay,dflash:5:lookup,dflash:7:lookup,"
                 "hf,hf-lookup:3,hf-lookup:5")
ASSISTANT_MODES = "draft_model:3,draft_model:3:lookup,hf-assisted:5,hf-assisted-default:20"  # k: the best of 3 / 5 here; 20 is transformers' default


def add_perf_commands(sub) -> None:
    """Register `bench` on the CLI's subparsers (`gpu-check`: add_gpu_check_command)."""
    from blockspec.services.training.default_pair import default_home

    home = default_home() / "base"
    bn = sub.add_parser("bench", help="speculative vs plain decoding vs transformers, side by side (BENCHMARKS.md)")
    bn.add_argument("--target", default=str(home / "target"), help="default: the shipped pair's target")
    bn.add_argument("--drafter", default=str(home / "drafter"), help="default: the shipped pair's drafter")
    bn.add_argument("--prompts-file", default=str(home / "heldout_prompts.jsonl"), help="default: held-out prompts")
    bn.add_argument("--num-prompts", type=int, help="use the first N prompts")
    bn.add_argument("--max-tokens", type=bounded(1), default=128, help="new tokens per request (default 128)")
    bn.add_argument("--modes", help="comma list: none, ngram:K, draft_model:K, dflash:K (':adaptive' after K: adaptive "
                    "k up to K; ':replay': the drafts of an untimed run given back at no cost; ':lookup': prompt lookup first, "
                    "the drafter for the rest; dflash ':treeN' or ':treeNxM...': a draft tree, N children per node at "
                    "depth 1, M at 2, ...), hf, hf-lookup:K, "
                    "hf-assisted:K (fixed k, threshold 0), hf-assisted-default:K (transformers' schedule from K; "
                    f"draft_model and hf-assisted need --assistant). Default: {DEFAULT_MODES}, and with an assistant "
                    f"{ASSISTANT_MODES}")
    bn.add_argument("--concurrency", default="1,2,4,8,16", help="comma list (transformers modes run at 1)")
    bn.add_argument("--assistant", default=str(home / "assistant") if (home / "assistant" / "config.json").is_file()
                    else None, help="draft model directory for draft_model and the hf-assisted modes (default: the "
                    "shipped pair's assistant)")
    bn.add_argument("--request-rates", help="comma list of requests per second: also run open loop, requests arriving "
                    "at each rate (Poisson, the same times for every mode), TTFT from arrival (engine modes; --server too)")
    bn.add_argument("--max-concurrency", type=int, default=16, help="open loop: requests in flight at most (default 16)")
    bn.add_argument("--server", type=address, help="HOST:PORT of a running server's gRPC API (server.grpc_port): "
                    "measure it instead (its method, --server-k values)")
    bn.add_argument("--server-k", help="--server: comma list of num_speculative_tokens per request (0: plain decoding "
                    "on any server, the baseline of the ratios and of `exact`; default 0 and the server's default k, "
                    "0 alone on a server without a drafter)")
    add_tls_client_args(bn)
    samp = bn.add_argument_group("sampling (default: greedy; docs/sampling.md)")
    samp.add_argument("--temperature", type=float, default=0.0, help="every request's; 0 = greedy (default)")
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--top-k", type=bounded(0, UINT32), default=0, help="0 = off")
    samp.add_argument("--seed", type=bounded(0, UINT64), default=0, help="request i of a pass is seeded SEED + i, in "
                      "every mode and pass (default 0)")
    samp.add_argument("--rule", choices=RULES, default="rejection", help="verification rule; `exact` compares outputs "
                      "with plain decoding's under strict only")
    bn.add_argument("--out", default="bench-out", help="directory for bench.md, bench.json and the PNG plots")
    bn.add_argument("--threads", type=threads, help="torch CPU threads")
    bn.add_argument("--rounds", type=int, default=3, help="timed passes per mode, interleaved; the median pass is "
                    "reported (of an even number, the faster middle one)")
    bn.add_argument("--waves", type=int, default=4, help="a pass at concurrency c serves at least WAVES x c requests "
                    "(the prompts cycled), c in flight: mostly steady state, not one wave's ramp and tail")
    add_device_args(bn)
    bn.set_defaults(func=cmd_bench)


def add_gpu_check_command(sub) -> None:
    """Register `gpu-check`: its parser alone (services/cli/main.py's LIGHT) needs none of the serving packages."""
    gc = sub.add_parser("gpu-check", help="step costs against the floor, throughput, exactness on random targets")
    gc.add_argument("--sizes", default="1b,8b,27b,27b-hybrid",
                    help="comma list of tiny, 1b, 8b, 27b (the reference shape), tiny-hybrid, 27b-hybrid (Qwen3.5-27B)")
    gc.add_argument("--device", default="cuda")
    gc.add_argument("--out", help="directory for gpu_check.md and gpu_check.json")
    gc.add_argument("--backend", default="auto", choices=("auto", "eager", "graphs"),
                    help="the verifier's runner (auto: the captured CUDA runner on CUDA)")
    gc.add_argument("--peer", action="store_true", help="also transformers' compiled generate per size (its compile "
                                                       "takes the longest: give the sizes time for it)")
    gc.add_argument("--budget-s", type=_budget, default=None,
                    help="seconds a size may take before its optional stages (loop overhead, numerics, --peer) are "
                         "left out (default 90: the smoke stage and four sizes in 8 minutes; 0: no budget)")
    gc.add_argument("--no-smoke", action="store_true",
                    help="leave out the smoke stage that runs first (versions, each operator's time, row invariance "
                         "and error against fp32 at the reference shapes, the cuBLAS probe; at most 60 s)")
    gc.set_defaults(func=cmd_gpu_check)


def cmd_bench(args: argparse.Namespace) -> int:
    """Side-by-side measurement of the modes at each concurrency; writes bench.md/json and plots to --out."""
    from blockspec.services.bench.modes import parse_modes
    from blockspec.services.bench.run import run_bench

    set_threads(args.threads)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidArgument("--num-prompts", f"must be at least 1, got {args.num_prompts}")
    concurrency = _int_list("--concurrency", args.concurrency)
    rounds = _int_list("--rounds", str(args.rounds))[0]
    waves = _int_list("--waves", str(args.waves))[0]
    try:
        sampling = checked(SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                           seed=args.seed, rule=args.rule), UINT32)
    except InvalidArgument as e:  # sampling.X is --X
        raise InvalidArgument(as_flag(e.field), e.message) from None
    rates = _rate_list(args.request_rates) if args.request_rates else []
    cap = _int_list("--max-concurrency", str(args.max_concurrency))[0]
    if args.server is not None:
        return _bench_server(args, concurrency, rounds, waves, rates, cap, sampling)
    from blockspec.common.models.checkpoint import load_checkpoint

    target = Path(args.target)
    tokenizer = load_checkpoint(target, with_weights=False).tokenizer
    prompts = [tokenizer.encode(t) for t in _bench_prompts(args)]
    modes = parse_modes(args.modes or DEFAULT_MODES + ("," + ASSISTANT_MODES if args.assistant else ""))
    out = out_dir(args.out)
    result = run_bench(target, Path(args.drafter) if args.drafter else None, prompts, modes,
                       concurrency, args.max_tokens, out, Path(args.assistant) if args.assistant else None,
                       rounds=rounds, waves=waves, device=resolve_device(args.device, args.dtype),
                       request_rates=rates, max_concurrency=cap, sampling=sampling)
    print(result["markdown"])
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {', '.join(result['plots'])}")
    return 0


def _connect(args: argparse.Namespace):
    """`bench --server`'s channels: $BLOCKSPEC_API_KEY sent, TLS as its flags ask."""
    import functools

    from blockspec.common.wire.auth import client_channel

    return functools.partial(client_channel, tls=client_tls(args))


def _bench_server(args: argparse.Namespace, concurrency: list[int], rounds: int, waves: int, rates: list[float],
                  cap: int, sampling: SamplingParams) -> int:
    """`bench --server`: the workload over a running server's gRPC API, each --server-k value (0: plain decoding, the
    baseline of the ratios and of `exact`) `rounds` times, interleaved, closed and open loop."""
    import grpc

    from blockspec.services.bench.server import ServerStreamError, server_passes

    ks = _int_list("--server-k", args.server_k, minimum=0) if args.server_k else None
    out = out_dir(args.out)
    try:
        rows, rate_rows, prompts = server_passes(args.server, _bench_prompts(args), args.max_tokens, ks, concurrency,
                                                 rounds, waves, rates, cap, _connect(args), sampling)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidArgument("--server-k" if "num_speculative_tokens" in e.details() else "request",
                                  e.details()) from None
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # the HTTP port, perhaps: refused naming it
            check_speaks("--server", args.server, GRPC, client_tls(args))
        print(f"blockspec: error: server {args.server}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except ServerStreamError as e:
        print(f"blockspec: error: server {args.server}: {e}", file=sys.stderr)
        return 1
    from blockspec.services.bench.report import markdown, plots
    from blockspec.services.bench.run import describe_sampling

    header = (f"Server {args.server}; {len(prompts)} prompts x {args.max_tokens} tokens, "
              f"{describe_sampling(sampling, 'every k')}; a pass at concurrency c "
              f"serves max({len(prompts)}, {waves} c) requests, c streams at a time. Each row is the pass with the median "
              f"tokens/s of {rounds} interleaved passes; `server` is plain decoding (num_speculative_tokens 0), the "
              "ratios' baseline.")
    report = markdown(rows, None, header, rate_rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.md").write_text(report)
    result = {"server": args.server, "prompts": len(prompts), "max_tokens": args.max_tokens, "waves": waves,
              "sampling": asdict(sampling),
              "rows": [asdict(r) for r in rows], "rate_rows": [asdict(r) for r in rate_rows]}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    paths = plots(rows, out, rate_rows)
    print(report)
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {', '.join(map(str, paths))}")
    return 0


def _int_list(flag: str, text: str, minimum: int = 1) -> list[int]:
    """Comma-separated integers of at least `minimum`, each once."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument(flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < minimum for v in values):
        raise InvalidArgument(flag, f"expected integers of at least {minimum}, got {text!r}")
    return _once(flag, values, text)


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgument("--request-rates", f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise InvalidArgument("--request-rates", f"expected positive finite requests per second, got {text!r}")
    return _once("--request-rates", values, text)


def _once(flag: str, values: list, text: str) -> list:
    """values, if none is given twice (a repeated one gave duplicate rows, mixed with another block's cost slices)."""
    if len(set(values)) < len(values):
        raise InvalidArgument(flag, f"each value once, got {text!r}")
    return values


def _bench_prompts(args: argparse.Namespace) -> list[str]:
    prompts = read_prompts(None, args.prompts_file)
    return prompts[: args.num_prompts] if args.num_prompts else prompts


def cmd_gpu_check(args: argparse.Namespace) -> int:
    from blockspec.services.bench import gpu_check
    from blockspec.services.bench.gpu_sizes import SIZES

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if not sizes or unknown:
        raise InvalidArgument("--sizes", f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    resolve_device(args.device)
    budget = gpu_check.SIZE_BUDGET_S if args.budget_s is None else args.budget_s or None
    return gpu_check.main(sizes, args.device, out_dir(args.out) if args.out else None, args.backend, args.peer, budget,
                          smoke=not args.no_smoke)


def _budget(value: str) -> float:
    seconds = float(value)
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{value} is not a number of seconds >= 0")
    return seconds
