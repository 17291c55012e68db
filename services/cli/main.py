"""The `blockspec` command line: the parser, `serve`, `role`, `config` and `check-invariance`; `generate`, `batch`,
`validate`, `rollout`, the model commands and the performance commands are registered from their own files."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from blockspec.common.argtypes import address, bounded, port
from blockspec.common.errors import InvalidArgument
from blockspec.services.cli.args import as_flag
from blockspec.services.cli.rollout import add_rollout_command


def _add_gpu_check(sub) -> None:
    from blockspec.services.cli.perf import add_gpu_check_command

    add_gpu_check_command(sub)


# Commands whose parser is built alone: `blockspec rollout ...` never loads torch, so it answers in a fraction of a
# second instead of after torch's import (seconds, more on a busy machine); `gpu-check` runs on GPU machines that
# have none of the serving packages (pydantic, opentelemetry, ray, uvicorn), which the other commands' parsers import.
LIGHT = {"rollout": add_rollout_command, "gpu-check": _add_gpu_check}

log = logging.getLogger(__name__)


def cmd_check_invariance(args: argparse.Namespace) -> int:
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.verifier.invariance import measure

    checkpoint = load_checkpoint(args.target)
    path = Path(args.text_file)
    if not path.is_file():
        raise InvalidArgument("--text-file", f"{path} is not a file")
    ids = checkpoint.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    window = min(256, checkpoint.config.max_position_embeddings - 1)
    if max(args.k) >= window:
        raise InvalidArgument("-k", f"{max(args.k)}: each k must be below the {window}-token window")
    sequences = [ids[i : i + window] for i in range(0, len(ids) - window, window)][: args.sequences]
    if not sequences:
        raise InvalidArgument("--text-file", f"{path} holds fewer than {window} tokens")
    print("| mode | positions | argmax mismatches | mismatch rate | max abs logit diff |")
    print("|---|---|---|---|---|")
    for invariant in (False, True):
        r = measure(checkpoint, sequences, args.k, invariant)
        print(f"| {r.mode} | {r.positions} | {r.argmax_mismatches} | {r.mismatch_rate:.2e} | {r.max_abs_diff:.2e} |")
    return 0


def cmd_role(args: argparse.Namespace) -> int:
    """Serve one role in this process (started by `serve --no-ray`, compose or Ray); prints LISTENING <port>."""
    from blockspec.common.wire.grpc_server import BindError
    from blockspec.services.serving import launch

    launch.watch_supervisor()  # before loading: a server gone meanwhile ends this role too
    try:
        service = launch.role_service(args)
    except InvalidArgument as e:  # the engine's field names, said as the role's flags
        raise InvalidArgument(as_flag(e.field), e.message) from None
    try:
        launch.run_role_process(args.role, service, args.host, args.port, args.unix_socket)
    except BindError as e:  # a host not ours, a port taken, a socket path whose directory is missing
        print(f"blockspec: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the configuration reference, or a config file as the server reads it (every default filled in)."""
    if args.reference:
        from blockspec.common.config_reference import reference

        print(reference())
        return 0
    if args.config is None:
        raise InvalidArgument("config", "give a config file to check, or --reference")
    import yaml

    from blockspec.common.config import load_config

    print(yaml.safe_dump(load_config(args.config).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Whether a config's roles fit a GPU, or a CPU config's this machine's RAM (`serving/plan.py`): a table, or
    --json; exit 1 when one does not."""
    import json

    import torch

    from blockspec.common.config import load_config
    from blockspec.services.serving.plan import machine_memory, parse_size, plan_capacity

    cfg = load_config(args.config)
    if args.gpu_memory is not None:  # a GPU of this size, whatever model.device says
        memory, device, source = parse_size(args.gpu_memory), "cuda", f"--gpu-memory {args.gpu_memory}"
    else:
        device = torch.device(cfg.model.device).type
        memory, source = machine_memory(cfg.model.device)
    result = plan_capacity(cfg, memory, args.replicas, device, source, tuple(args.avg_len or ()))
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())
    return 0 if result.fits else 1


def cmd_serve(args: argparse.Namespace) -> int:
    from blockspec.common.config import check_ports, load_config
    from blockspec.common.wire.grpc_server import BindError
    from blockspec.services.serving.launch import freeze_for_exit
    from blockspec.services.serving.serve import RoleStartError, serve_external, serve_processes

    cfg = load_config(args.config)
    if args.ray_address and (args.no_ray or args.verifier_address):
        raise InvalidArgument("--ray-address", "serves on Ray: not with --no-ray or --verifier-address")
    if args.inprocess and (args.no_ray or args.ray_address or args.verifier_address):
        raise InvalidArgument("--inprocess", "runs the roles in this process: not with --no-ray, --ray-address or "
                                             "--verifier-address")
    if args.drafter_address and not args.verifier_address:
        raise InvalidArgument("--drafter-address", "goes with --verifier-address (the router alone)")
    host = args.host or cfg.server.host
    port = cfg.server.port if args.port is None else args.port
    grpc_port = cfg.server.grpc_port if args.grpc_port is None else args.grpc_port
    check_ports(port, grpc_port, "--grpc-port" if args.grpc_port is not None or args.port is not None else "server.grpc_port")
    try:
        if args.inprocess:
            from blockspec.services.serving.inprocess import serve_inprocess

            return serve_inprocess(cfg, host, port, grpc_port)
        if args.verifier_address:
            return serve_external(cfg, host, port, grpc_port, args.verifier_address, args.drafter_address)
        if args.no_ray:
            return serve_processes(cfg, host, port, grpc_port)
        from blockspec.services.serving.ray_placement import serve_ray

        return serve_ray(cfg, host, port, grpc_port, args.ray_address)
    except (RoleStartError, BindError) as e:  # a role that ended before it served (it printed why), no room on Ray
        print(f"blockspec: error: {e}", file=sys.stderr)  # for one, a port taken by another process
        return 1
    finally:
        freeze_for_exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; for a command in LIGHT, that command alone."""
    parser = argparse.ArgumentParser(prog="blockspec", description="Lossless block speculative decoding")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    if command in LIGHT:
        LIGHT[command](sub)
        return parser
    from blockspec.services.cli.batch import add_batch_command
    from blockspec.services.cli.generate import add_generate_command
    from blockspec.services.cli.models import add_model_commands
    from blockspec.services.cli.perf import add_perf_commands
    from blockspec.services.cli.validate import add_validate_command
    from blockspec.services.serving.role_args import add_role_arguments

    add_generate_command(sub)
    add_batch_command(sub)
    add_model_commands(sub)
    sv = sub.add_parser("serve", help="serve the gRPC API (and HTTP /health, /metrics) from a config file")
    sv.add_argument("--config", required=True, help="config.yaml (docs/configuration.md)")
    sv.add_argument("--host", help="bind address (default: server.host)")
    sv.add_argument("--port", type=port, help="HTTP port for /health and /metrics (default: server.port, 8000)")
    sv.add_argument("--grpc-port", type=port, help="gRPC port (default: server.grpc_port, 8001)")
    sv.add_argument("--no-ray", action="store_true", help="run the roles as plain supervised processes")
    sv.add_argument("--inprocess", action="store_true",
                    help="run the roles in this process, no role round trips (one replica; docs/operations.md)")
    sv.add_argument("--ray-address", help="join this Ray cluster instead of starting a local one")
    sv.add_argument("--verifier-address", type=address, help="HOST:PORT of a running verifier role: start only the router")
    sv.add_argument("--drafter-address", type=address, help="HOST:PORT of a running drafter role (with --verifier-address)")
    sv.set_defaults(func=cmd_serve)
    cf = sub.add_parser("config", help="check a config file and print it with its defaults, or print the reference")
    cf.add_argument("config", nargs="?", help="config.yaml to check")
    cf.add_argument("--reference", action="store_true", help="print every key (docs/configuration.md)")
    cf.set_defaults(func=cmd_config)
    pl = sub.add_parser("plan", help="how a config's roles split a GPU (a CPU config: this machine's RAM), the KV "
                                     "tokens that fit, requests at once and the longest context, and what to lower")
    pl.add_argument("--config", required=True, help="the server's config.yaml")
    pl.add_argument("--gpu-memory", help="plan on a GPU of this memory, e.g. 80GB, 141GB or 80GiB, whatever "
                    "model.device says (default: model.device's memory here: the GPU's, or the RAM available)")
    pl.add_argument("--replicas", type=bounded(1, 64), default=1, help="replicas sharing the memory (default 1)")
    pl.add_argument("--avg-len", type=bounded(1), action="append",
                    help="an average request length (prompt and output tokens) to count requests at once at; "
                         "repeatable (default: max_model_len and half of it)")
    pl.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    pl.set_defaults(func=cmd_plan)
    add_validate_command(sub)
    for add in LIGHT.values():
        add(sub)
    add_perf_commands(sub)
    role = sub.add_parser("role", help="serve one role (verifier or drafter); used by serve, compose and Ray")
    add_role_arguments(role)
    role.set_defaults(func=cmd_role)
    inv = sub.add_parser("check-invariance", help="compare (k+1)-token verify with 1-token decode logits")
    inv.add_argument("--target", required=True, help="target checkpoint directory")
    inv.add_argument("--text-file", required=True, help="text whose tokens are verified and decoded")
    inv.add_argument("-k", type=bounded(1), nargs="+", default=[1, 3, 5, 7], help="draft lengths to check")
    inv.add_argument("--sequences", type=bounded(1), default=8, help="256-token windows of the text to use")
    inv.set_defaults(func=cmd_check_invariance)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except InvalidArgument as e:
        print(f"blockspec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
