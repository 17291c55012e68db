"""Wiring of the three roles: build each role's service, serve it, and connect a router to them.

The one place that knows all three services (like the in-process engine); the roles themselves never
import each other.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.common.config import DEFAULT_K, RoutingConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.backends import uses_cuda_runner
from blockspec.common.runtime.device import MemorySplit, claim_gpu_share, kv_cache_blocks, role_fraction
from blockspec.common.runtime.device import resolve as resolve_device
from blockspec.common.runtime.footprint import STEP_RESERVE
from blockspec.common.telemetry import tracing
from blockspec.common.telemetry.metrics import DEFAULT_VERSION, RouterMetrics
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS
from blockspec.common.wire.auth import ENV_ROLE_KEY, ApiKeys, role_interceptors
from blockspec.common.wire.grpc_server import start_server
from blockspec.common.wire.tensor_share import remove_orphans
from blockspec.common.wire.tls import ENV_ROLE_TLS, ServerTls, role_server_tls
from blockspec.protos import roles_grpc, roles_pb2
from blockspec.services.drafter.proposers import METHODS, check_method, verifier_needs
from blockspec.services.drafter.proposers.none import NoneProposer
from blockspec.services.drafter.service import DrafterService
from blockspec.services.engine.engine import serving_len
from blockspec.services.router.app import RouterServer, close_roles, start_router
from blockspec.services.router.limits import TenantLimits
from blockspec.services.router.messages import ModelFacts
from blockspec.services.router.roles import RemoteDrafter, RemoteVerifier
from blockspec.services.router.step_loop import DEFAULT_PREFILL_CHUNK, StepLoop
from blockspec.services.verifier.service import VerifierService
from blockspec.services.verifier.verifier import Verifier

log = logging.getLogger(__name__)

ENV_SUPERVISOR = "BLOCKSPEC_SUPERVISOR_PID"  # set by `serve` for the role processes it starts (watch_supervisor)
SUPERVISOR_POLL_S = 1.0
# OpenMP (libgomp) threads spin this many times after a parallel region before they sleep. libgomp's default keeps
# a role's threads spinning well past its forward while the router and the other role wait for a core, which costs
# a split step far more than the wake-up a shorter spin costs; inside one process nothing waits for the core.
ROLE_ENV_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
VERIFIER_SERVICE = roles_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
DRAFTER_SERVICE = roles_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
UNIX_PATH_MAX = 108  # bytes of a Unix socket's path on Linux, its terminating NUL included


def context_len(target: str, max_len: int | None) -> int:
    return serving_len(load_checkpoint(target, with_weights=False).config.max_position_embeddings, max_len)


def role_service(args) -> VerifierService | DrafterService:
    """The service of `blockspec role verifier|drafter ...` arguments."""
    check_method(args.method, args.drafter)  # a dflash verifier without its drafter cannot know its taps
    if args.role == "drafter" and args.method == "none":  # serve starts no drafter role for plain decoding
        raise InvalidArgument("--method", "a drafter role with method 'none' would draft nothing; choose one of "
                                          f"{', '.join(m for m in METHODS if m != 'none')}")
    device, dtype = resolve_device(args.device, args.dtype)
    fraction = role_fraction(torch.device(device), MemorySplit.from_args(args), args.role)
    if args.role == "verifier":
        return verifier_service(args.target, args.method, args.drafter, args.max_batch, args.max_model_len, device,
                                dtype, args.invariant, fraction, args.runner, args.tensor_parallel_size,
                                KvCacheConfig(args.kv_cache_tokens, args.kv_block_size, not args.no_prefix_caching))
    return DrafterService(args.method, args.drafter, args.target, args.max_batch,
                          context_len(args.target, args.max_model_len), not args.no_dynamic_conv,
                          not args.no_path_selector, device, dtype, fraction)


@dataclass(frozen=True)
class KvCacheConfig:
    """The verifier's paged KV cache (model.kv_cache_tokens, model.kv_block_size, model.prefix_caching)."""

    tokens: int | None = None  # unset: on a GPU what the verifier's share leaves, on the CPU max_batch x max_len
    block_size: int = BLOCK_TOKENS
    prefix_caching: bool = True


def verifier_service(target: str, method: str, drafter: str | None, max_batch: int, max_len: int | None,
                     device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     invariant: bool = False, gpu_fraction: float | None = None,
                     runner: str = "auto", tensor_parallel_size: int = 1,
                     kv: KvCacheConfig = KvCacheConfig()) -> VerifierService:
    """The verifier role; on a GPU with a memory share (`gpu_fraction`), its KV blocks are what the share leaves
    beside its weights, states and buffers (or kv.tokens'), refused before it allocates where they do not hold one
    request of max_len (tensor_parallel_size > 1: the lead rank's part, a slot of max_len a request)."""
    dflash_cfg = None
    if method == "dflash":
        from blockspec.services.drafter.dflash.checkpoint import load_drafter

        dflash_cfg = load_drafter(drafter).cfg
    tap_layers, max_k = verifier_needs(method, dflash_cfg)
    checkpoint, length = load_checkpoint(target), context_len(target, max_len)
    dev = torch.device(device)
    graphs = uses_cuda_runner(checkpoint.config, dev, runner)
    layout = Verifier.layout(checkpoint, max_batch, tap_layers, dtype, graphs, tensor_parallel_size, kv.block_size,
                             length)
    on_gpu = dev.type == "cuda" and gpu_fraction is not None
    if tensor_parallel_size > 1:  # the ranks keep a slot of max_len a request
        blocks = max_batch * layout.blocks_for(length)
        claim_gpu_share(dev, gpu_fraction, layout.held(blocks) + STEP_RESERVE, "verifier")
    else:
        total = torch.cuda.get_device_properties(dev).total_memory if on_gpu else None
        blocks = kv_cache_blocks(layout, length, total, gpu_fraction, kv.tokens)
        held = layout.held(blocks or max_batch * layout.blocks_for(length))
        claim_gpu_share(dev, gpu_fraction, held + STEP_RESERVE, "verifier")
    verifier = Verifier(checkpoint, max_batch, length, max_k + 1 if invariant else None,
                        tap_layers=tap_layers, dtype=dtype, device=device, backend=runner,
                        tensor_parallel_size=tensor_parallel_size, kv_blocks=blocks, block_size=kv.block_size,
                        prefix_caching=kv.prefix_caching)
    return VerifierService(verifier, str(target))


async def serve_verifier(service: VerifierService, host: str = "127.0.0.1", port: int = 0, unix_socket: str | None = None):
    return await start_server(lambda s: roles_grpc.add_VerifierServicer_to_server(service, s), (VERIFIER_SERVICE,), host,
                              port, unix_socket, role_interceptors(), _role_credentials())


async def serve_drafter(service: DrafterService, host: str = "127.0.0.1", port: int = 0, unix_socket: str | None = None):
    return await start_server(lambda s: roles_grpc.add_DrafterServicer_to_server(service, s), (DRAFTER_SERVICE,), host,
                              port, unix_socket, role_interceptors(), _role_credentials())


def _role_credentials():
    """A role's TCP port: mutual TLS where BLOCKSPEC_ROLE_TLS_* are set (common/wire/tls.py), else plaintext."""
    tls = role_server_tls()
    return tls.grpc_credentials() if tls is not None else None


def role_socket(name: str) -> str | None:
    """Where a role started by this process (`serve`) listens besides its port, for a router on the same host: a
    Unix domain socket in the temp directory (None where that path is too long for one): a role round trip over it
    is a little cheaper than over TCP loopback, and it is not reachable from other machines."""
    path = os.path.join(tempfile.gettempdir(), f"blockspec-{os.getpid()}-{name}.sock")
    return path if len(path.encode()) < UNIX_PATH_MAX else None


def remove_role_sockets(owner: int | None = None) -> list[str]:
    """Delete role sockets (`role_socket`) left in the temp directory: those of the server `owner` (its roles are
    gone: Ray actors ended by ray.kill never stop their gRPC server, which would remove its socket), or with
    owner None those whose server no longer runs (a killed server). Returns the names removed."""
    return remove_orphans(Path(tempfile.gettempdir()), "blockspec-*-*.sock", owner)


def connect_roles(verifier_addr: str, drafter_addr: str | Callable[[], str] | None) -> tuple[RemoteVerifier, object]:
    """Router-side role clients; without a drafter address the router decodes plainly."""
    verifier = RemoteVerifier(verifier_addr)
    drafter = RemoteDrafter(drafter_addr, verifier) if drafter_addr else NoneProposer()
    return verifier, drafter


async def start_split_router(replicas: Sequence[tuple[str, str | Callable[[], str] | None]], method: str,
                             max_batch: int, host: str = "127.0.0.1", port: int = 0, default_k: int = DEFAULT_K,
                             metrics: RouterMetrics | None = None, adaptive_k: bool = False,
                             prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, prompt_lookup: bool = False,
                             prompt_lookup_tokens: int | None = None, api_keys: ApiKeys | None = None,
                             limits: TenantLimits | None = None, tls: ServerTls | None = None,
                             version: str = DEFAULT_VERSION, routing: RoutingConfig = RoutingConfig()) -> RouterServer:
    """A router over remote roles: one (verifier address, drafter address or None) pair per replica."""
    roles = [await asyncio.to_thread(connect_roles, v, d) for v, d in replicas]
    facts = await asyncio.to_thread(role_facts, roles[0], method, default_k, version)
    loops = [StepLoop(v, d, max_batch, adaptive_k, prefill_chunk, prompt_lookup, prompt_lookup_tokens) for v, d in roles]
    try:
        return await start_router(loops, facts, host, port, metrics, api_keys, limits, tls, routing)
    except BaseException:  # e.g. its port taken
        close_roles(r for pair in roles for r in pair)
        raise


def role_facts(roles: tuple, method: str, default_k: int, version: str) -> ModelFacts:
    """What the router knows of the models behind connected role clients (a replica's verifier and drafter, or
    NoneProposer without one); the tokenizer is the target's own."""
    verifier, drafter = roles
    has_drafter = not isinstance(drafter, NoneProposer)
    target = verifier.info.target_path
    tokenizer = load_checkpoint(target, with_weights=False).tokenizer
    return ModelFacts(target=target, drafter=drafter.address if has_drafter else "", method=method if has_drafter else "none",
                      max_k=drafter.max_k, default_k=min(default_k, drafter.max_k), context_len=verifier.info.max_len,
                      vocab_size=verifier.info.vocab_size, tokenizer=tokenizer, version=version)


def role_env() -> dict[str, str]:
    """Variables a role process gets on top of the server's environment: ROLE_ENV_DEFAULTS, except where the
    server's own environment sets them (an operator's value wins), and the roles' key where set (a Ray actor
    gets no other environment of the server's)."""
    env = {name: os.environ.get(name, value) for name, value in ROLE_ENV_DEFAULTS.items()}
    passed = (ENV_ROLE_KEY, *ENV_ROLE_TLS.values())  # the role key and the role hops' TLS files
    return env | {name: os.environ[name] for name in passed if os.environ.get(name)}


def watch_supervisor() -> None:
    """A role started by `serve --no-ray` (the server's pid in ENV_SUPERVISOR) stops itself once that process
    is gone, however it ended (SIGKILL, a crash, SIGTERM while the roles were still loading): no role outlives
    its server holding a port, memory or a GPU. Roles started any other way are left alone."""
    pid = os.environ.get(ENV_SUPERVISOR)
    if not pid:
        return

    def watch() -> None:
        while os.getppid() == int(pid):
            time.sleep(SUPERVISOR_POLL_S)
        log.warning("the server (pid %s) is gone; stopping", pid)
        os.kill(os.getpid(), signal.SIGTERM)  # the role's own graceful stop (or, while loading, the default)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def run_role_process(kind: str, service, host: str, port: int, unix_socket: str | None = None) -> None:
    """Serve one role until SIGTERM/SIGINT; shared segments are removed on the way out."""
    tracing.setup_tracing(f"blockspec-{kind}")

    async def main() -> None:
        serve = serve_verifier if kind == "verifier" else serve_drafter
        server, _, bound = await serve(service, host, port, unix_socket)
        print(f"LISTENING {bound}", flush=True)  # the supervisor reads the bound port from this line
        log.info("%s role listening on %s:%d", kind, host, bound)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop(1)

    try:
        asyncio.run(main())
    finally:
        service.close()
        tracing.shutdown_tracing()
        freeze_for_exit()


def freeze_for_exit() -> None:
    """Called by a serving process once it has shut down: the interpreter's last garbage collection walks every
    object torch, transformers and the model made (more than a second, idle, for the shipped pair) and nothing left
    needs it, so the heap is frozen out of it (gc.freeze) and the process exits at once. Files, logs and atexit
    handlers are still closed as usual."""
    gc.freeze()
