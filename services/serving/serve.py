"""`blockspec serve`: the roles as supervised processes (or Ray actors), the router, the HTTP port."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from blockspec.common.config import BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.runtime.device import resolve as resolve_device
from blockspec.common.telemetry import tracing
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.wire.auth import ApiKeys, ensure_role_key, role_channel
from blockspec.common.wire.grpc_server import check_bindable
from blockspec.common.wire.tensor_share import cleanup_stale
from blockspec.common.wire.tls import ENV_ROLE_TLS, ServerTls, role_client_tls, secure_channel
from blockspec.services.router.http import Ready, start_http
from blockspec.services.router.limits import TenantLimits
from blockspec.services.router.openai_http import Upstream, V1App
from blockspec.services.serving.admin import load_admin_key
from blockspec.services.serving.launch import (
    ENV_SUPERVISOR,
    remove_role_sockets,
    role_env,
    role_socket,
    start_split_router,
)
from blockspec.services.serving.startup import Startup, resolve_startup
from blockspec.services.serving.supervisor import route

log = logging.getLogger(__name__)

STALL_S = 30.0  # a step running longer than this makes /health answer 503
EXTERNAL_DOWN_S = 10.0  # router only: a verifier whose health check fails this long is gone (the router exits 1)
EXTERNAL_START_S = 300.0  # router only: how long roles started elsewhere may take to answer at start (loading)


class RoleStartError(RuntimeError):
    """A role that could not be started: a process that ended before it served (its own error on stderr), a Ray
    actor that died loading or found no room, roles elsewhere that never answered. `serve` exits 1 with one line."""


class RoleProcess:
    """One role as a child process; it prints `LISTENING <port>` once serving. Restarted on the same port (and
    socket). With a Unix socket path the role listens there too, and that is its address."""

    def __init__(self, name: str, argv: tuple[str, ...], host: str = "127.0.0.1", port: int = 0,
                 unix_socket: str | None = None) -> None:
        self.name, self.argv, self.host = name, argv, host
        self.port, self.unix_socket = port, unix_socket
        self.restarts = 0
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        # ENV_SUPERVISOR: the role ends when this process does.
        socket_args = ("--unix-socket", self.unix_socket) if self.unix_socket else ()
        proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", *self.argv, "--host", self.host,
                                 "--port", str(self.port), *socket_args], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **role_env(), ENV_SUPERVISOR: str(os.getpid())})
        for line in proc.stdout:
            if line.startswith("LISTENING "):
                self.port = int(line.split()[1])
                return proc
        raise RoleStartError(f"the {self.name} role exited before serving (code {proc.wait()}); its error is above")

    @property
    def address(self) -> str:
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> None:
        log.warning("%s role exited (code %s); restarting on port %d", self.name, self.proc.poll(), self.port)
        self.proc = self._spawn()
        self.restarts += 1

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def role_healthy(address: str, timeout_s: float = 1.0) -> bool:
    try:
        with secure_channel(address, role_client_tls()) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _wait_for(address: str, flag: str) -> None:
    """Router only: wait for a role started elsewhere to answer its health check (it may still be loading), saying
    so every 10 s; one that has not answered in EXTERNAL_START_S ends the start with RoleStartError."""
    started = time.monotonic()
    next_note = started
    while not role_healthy(address):
        now = time.monotonic()
        if now - started >= EXTERNAL_START_S:
            raise RoleStartError(f"{flag} {address}: no role answered there within {EXTERNAL_START_S:g} s")
        if now >= next_note:
            log.warning("router only: waiting for the role at %s (%s) to answer", address, flag)
            next_note = now + 10.0
        time.sleep(0.5)


class ExternalRole:
    """A role started by someone else (compose, systemd): only its address. A watched one (the verifier: the router
    cannot go on without it) counts as gone once its health check has failed for EXTERNAL_DOWN_S in a row, and the
    router then exits 1 for its supervisor to restart both; an unwatched one (the drafter) never does: its requests
    run at k=0 meanwhile and the router reconnects when it is back."""

    def __init__(self, address: str, watched: bool = False) -> None:
        self.address, self.watched = address, watched
        self._down_since: float | None = None

    def alive(self) -> bool:
        if not self.watched or role_healthy(self.address):
            self._down_since = None
            return True
        now = time.monotonic()
        self._down_since = self._down_since or now
        return now - self._down_since < EXTERNAL_DOWN_S

    def stop(self) -> None:
        pass


def _answers(role) -> bool:
    try:
        return role_healthy(role.address)
    except Exception:  # no address right now (restarting)
        return False


def serve_processes(cfg: BlockspecConfig, host: str, port: int, grpc_port: int) -> int:
    """Roles as supervised child processes (a verifier and a drafter per replica), router and HTTP here."""
    cleanup_stale()
    remove_role_sockets()  # of servers that were killed
    ensure_role_key()  # the roles answer only this process
    autoscaling = cfg.server.autoscaling
    most = autoscaling.max_replicas if autoscaling else cfg.server.replicas
    p = resolve_startup(cfg, replicas_per_gpu=most)  # every replica on model.device, each with its share of the memory
    resolve_device(cfg.model.device, cfg.model.dtype, "model.device", "model.dtype")  # the roles run on this machine

    def role(name: str, argv: tuple[str, ...]) -> RoleProcess:
        return RoleProcess(name, argv, unix_socket=role_socket(name) if cfg.server.unix_sockets else None)

    def starter(c: BlockspecConfig, prefix: str) -> Callable[[int], tuple]:
        q = p if c is cfg else resolve_startup(c, replicas_per_gpu=most)

        def start_replica(r: int) -> tuple:
            return (role(f"verifier-{prefix}{r}", q.verifier_argv),
                    role(f"drafter-{prefix}{r}", q.drafter_argv) if q.drafter_argv else None)

        return start_replica

    def start_roles():
        return [starter(cfg, "")(r) for r in range(cfg.server.replicas)]

    return serve_roles(cfg, p, host, port, grpc_port, start_roles, starter=starter)


def serve_external(cfg: BlockspecConfig, host: str, port: int, grpc_port: int, verifier: str, drafter: str | None) -> int:
    """Only the router: the roles run elsewhere (docker-compose, systemd units) at the given addresses."""
    p = resolve_startup(cfg)
    if p.drafter_argv and not drafter:
        raise InvalidArgument("--drafter-address", f"method {p.method} needs a drafter role address")
    if cfg.server.replicas != 1:
        raise InvalidArgument("server.replicas", "with --verifier-address the router serves exactly one replica")

    def start_roles():
        _wait_for(verifier, "--verifier-address")
        if p.drafter_argv:
            _wait_for(drafter, "--drafter-address")
        _warn_role_settings(cfg, p, verifier)
        return [(ExternalRole(verifier, watched=True), ExternalRole(drafter) if p.drafter_argv else None)]

    return serve_roles(cfg, p, host, port, grpc_port, start_roles)


def _warn_role_settings(cfg: BlockspecConfig, p: Startup, verifier: str) -> None:
    """Router only: the roles run with their own command lines, so the config's role-side keys (max_batch beyond
    the verifier's slots, max_model_len, device, dtype, invariant, the drafter's modules) do not reach them. Say
    where the running verifier differs, and the role command lines this config implies."""
    from blockspec.protos import roles_grpc, roles_pb2

    try:
        with role_channel(verifier) as channel:
            info = roles_grpc.VerifierStub(channel).Info(roles_pb2.InfoRequest(), timeout=300, wait_for_ready=True)
    except grpc.RpcError as e:
        log.warning("router only: cannot ask the verifier at %s for its settings (%s)", verifier, e.code().name)
        return
    differs = []
    if cfg.server.max_batch > info.num_slots:
        differs.append(f"server.max_batch {cfg.server.max_batch} > its {info.num_slots} slots (at most "
                       f"{info.num_slots} requests step together)")
    if cfg.model.max_model_len and cfg.model.max_model_len != info.max_len:
        differs.append(f"model.max_model_len {cfg.model.max_model_len} != its {info.max_len}")
    if differs:
        log.warning("router only: the verifier at %s runs with its own command line: %s. This config implies: %s; %s",
                    verifier, "; ".join(differs), " ".join(p.verifier_argv),
                    " ".join(p.drafter_argv) if p.drafter_argv else "no drafter")


def serve_roles(cfg: BlockspecConfig, p: Startup, host: str, port: int, grpc_port: int, start_roles,
                router_over: Callable | None = None, starter: Callable | None = None) -> int:
    """Run until SIGTERM/SIGINT: HTTP first (503 while loading), then the roles, then the router.

    `start_roles()` returns one (verifier, drafter or None) per replica; each has `.address`,
    `.alive()`, `.stop()` (and `.restart()` where this process supervises it). `router_over(replicas, keys, tls)`
    starts the router (a coroutine); by default one over the roles' addresses. starter(cfg, prefix) ->
    start_replica(index), one more pair of that config's version (blocking until both serve): for server.autoscaling,
    to replace a lost replica, and for rollouts."""
    if cfg.server.autoscaling is not None and starter is None:
        raise InvalidArgument("server.autoscaling", "scales the replicas serve starts: serve --no-ray or on Ray (not "
                                                    "--inprocess or --verifier-address)")
    state: dict = {"router": None, "replicas": []}
    tracing.setup_tracing("blockspec-router")
    keys = ApiKeys.load(cfg.server.api_keys_file) if cfg.server.api_keys_file else None
    if keys is None:  # every client is served: fine on loopback, worth a warning where others can connect
        log.log(logging.INFO if _loopback_only(host) else logging.WARNING,
                "server.api_keys_file is not set: every client that reaches %s is served (docs/operations.md)", host)
    tls = cfg.server.tls and ServerTls(cfg.server.tls.cert_file, cfg.server.tls.key_file,
                                       cfg.server.tls.client_ca_file, cfg.server.tls.min_version)
    role_tls = cfg.server.role_tls
    if role_tls is not None:  # the roles this process starts serve TCP with it, and the router's channels use it
        os.environ.update({ENV_ROLE_TLS["cert"]: role_tls.cert_file, ENV_ROLE_TLS["key"]: role_tls.key_file,
                           ENV_ROLE_TLS["ca"]: role_tls.ca_file})
    http = start_http(host, port, _readiness(state), keys, V1App(Upstream(lambda: _loopback(host, state))), tls)
    print(f"HTTP {http.server_port}", flush=True)
    log.info("HTTP%s on %s:%d (/health, /metrics, /v1)", "S" if tls else "", host, http.server_port)
    try:
        check_bindable(host, grpc_port)  # before the roles load: a taken port fails in a second, not after them
        if cfg.server.admin is not None:
            load_admin_key(cfg.server.admin.key_file)
            check_bindable(cfg.server.admin.host, cfg.server.admin.port)
        state["replicas"] = start_roles()
        router_over = router_over or (lambda replicas, keys, tls: _split_router(cfg, p, host, grpc_port, replicas,
                                                                                 keys, tls))
        return asyncio.run(route(cfg, router_over, http.server_port, state, keys, tls, _readiness(state), starter,
                                 resolve_startup))
    finally:
        http.shutdown()
        fleet = state.get("fleet")
        pairs = [p for r in fleet.versions for p in r.pairs] if fleet else state["replicas"]
        stop_together([role for pair in pairs for role in pair if role is not None])


def stop_together(roles: list) -> None:
    """Stop the roles at the same time: each waits for its process to exit, which one after another adds up."""
    if roles:
        with ThreadPoolExecutor(len(roles)) as pool:
            list(pool.map(lambda role: role.stop(), roles))
        tracing.shutdown_tracing()


def _loopback_only(host: str) -> bool:
    """Whether an address binds loopback only (no other machine can connect)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback(host: str, state: dict) -> str | None:
    """The router's gRPC address from this process (the /v1 paths call it), once it is up."""
    router = state["router"]
    if router is None:
        return None
    if router.loopback is not None:  # the public port speaks TLS: this process uses its own Unix socket
        return router.loopback
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "localhost"}.get(host, host)  # "::": ::1 or 127.0.0.1
    return f"[{host}]:{router.port}" if ":" in host else f"{host}:{router.port}"


def _readiness(state: dict) -> Callable[[], Ready]:
    """/health's answer from serve_roles' state: serving once the router is up, a verifier answers and no step is
    stalled; degraded (still serving) while some replica's verifier does not answer or was lost and its replacement is
    not yet ready (the others serve), or a drafter does not answer (k = 0). Replicas are named as in the router's
    metrics and logs."""

    def readiness() -> Ready:
        router = state["router"]
        if router is None:
            return Ready(False, "starting\n")
        fleet = state.get("fleet")  # the active version's replicas (a rollout's candidate does not count)
        replicas = list(fleet.active.pairs if fleet is not None else state["replicas"])
        names = [fleet.active.replica_name(pair) if fleet is not None else str(i) for i, pair in enumerate(replicas)]
        verifiers_down = [name for name, (verifier, _) in zip(names, replicas) if not _answers(verifier)]
        if replicas and len(verifiers_down) == len(replicas):  # none serves (--inprocess has no role to ask)
            return Ready(False, f"replica {', '.join(verifiers_down)}: verifier not answering\n")
        if router.stalled(STALL_S):
            return Ready(False, f"no step finished in {STALL_S:.0f} s\n")
        if verifiers_down:  # the others serve
            return Ready(True, f"degraded: replica {', '.join(verifiers_down)}: verifier not answering "
                               "(the other replicas serve)\n", degraded=True)
        autoscaler = state.get("autoscaler")
        if autoscaler is not None and autoscaler.replacing:
            return Ready(True, f"degraded: replica {', '.join(autoscaler.replacing)}: verifier lost, its replacement "
                               "is starting (the other replicas serve)\n", degraded=True)
        drafters_down = [name for name, (_, drafter) in zip(names, replicas) if drafter is not None
                         and not _answers(drafter)]
        if drafters_down:
            return Ready(True, f"degraded: replica {', '.join(drafters_down)}: drafter not answering "
                               "(requests run at k=0)\n", degraded=True)
        return Ready(True, "ok\n")

    return readiness


async def _split_router(cfg: BlockspecConfig, p: Startup, host: str, grpc_port: int, replicas, keys: ApiKeys | None,
                        tls: ServerTls | None):
    """The router over the started roles, reached by their addresses."""
    spec = cfg.model.spec_decode
    # A drafter's address is asked again at each reconnect (a restarted Ray actor has a new port).
    pairs = [(v.address, (lambda d=d: d.address) if d else None) for v, d in replicas]
    return await start_split_router(pairs, p.method, cfg.server.max_batch, host, grpc_port,
                                    default_k=spec.num_speculative_tokens, metrics=RouterMetrics(),
                                    adaptive_k=spec.adaptive_k, prompt_lookup=spec.prompt_lookup,
                                    prompt_lookup_tokens=spec.prompt_lookup_tokens,
                                    prefill_chunk=cfg.server.prefill_chunk_tokens, api_keys=keys,
                                    limits=TenantLimits(cfg.server.rate_limit), tls=tls, version=cfg.version,
                                    routing=cfg.server.routing)
