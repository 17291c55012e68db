"""Assemble a router gRPC server: the Generation API, grpc.health.v1 and reflection, over a step loop."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2

from blockspec.common.config import RoutingConfig
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS
from blockspec.common.wire.auth import ApiKeys, AuthInterceptor
from blockspec.common.wire.grpc_server import start_server
from blockspec.common.wire.tls import ServerTls
from blockspec.protos import api_pb2
from blockspec.services.router.limits import TenantLimits
from blockspec.services.router.messages import ModelFacts
from blockspec.services.router.prefix_routing import DEFAULT_CAPACITY_BLOCKS, prefix_router
from blockspec.services.router.scheduler import Scheduler
from blockspec.services.router.server import GenerationService, Version
from blockspec.services.router.step_loop import StepLoop

log = logging.getLogger(__name__)

SERVICE_NAME = api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class RouterServer:
    server: grpc.aio.Server
    health: grpc_health.aio.HealthServicer
    port: int
    service: GenerationService
    loopback: str | None = None  # unix:PATH, plaintext and owner-only, beside a TLS port (the HTTP front calls it)

    # The active version's replicas (new requests go there); service.versions holds every version.
    schedulers = property(lambda self: self.service.schedulers)
    draining = property(lambda self: self.service.draining)
    metrics = property(lambda self: self.service.metrics)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (or prefilling) over the active version's replicas, as their last steps left
        them."""
        return sum(s.waiting for s in self.schedulers)

    async def add_replica(self, step_loop: StepLoop, version: Version | None = None) -> Scheduler:
        """One more replica of `version` (default: the active one) over `step_loop` (its roles up): new requests may
        go to it from now on."""
        version = version or self.service.version
        label = max((int(s.replica) for s in version.schedulers), default=-1) + 1
        scheduler = Scheduler(step_loop, version.metrics, replica=label)
        await scheduler.start()
        version.schedulers.append(scheduler)
        return scheduler

    async def drain(self, scheduler: Scheduler, poll_s: float = 0.2, version: Version | None = None) -> None:
        """Send `scheduler` (a replica of `version`, default the active one) no new request, wait for its streams to
        finish, then stop it and close its role clients: nothing a client sent is cut."""
        version = version or self.service.version
        version.draining.add(scheduler)
        while scheduler.load:
            await asyncio.sleep(poll_s)
        version.schedulers.remove(scheduler)
        version.draining.discard(scheduler)
        await scheduler.stop()
        close_roles((scheduler.step_loop.verifier, scheduler.step_loop.drafter))

    def stalled(self, limit_s: float) -> bool:
        return any(s.stalled(limit_s) for v in self.service.versions.values() for s in v.schedulers)

    async def set_serving(self, ready: bool) -> None:
        """grpc.health.v1 as /health answers: NOT_SERVING while a role does not answer or a step is stalled."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving, then each step loop, then close its role clients' streams (a remote role otherwise sees
        its open stream cancelled when it stops and logs an error)."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for version in self.service.versions.values():
            for scheduler in version.schedulers:
                await scheduler.stop()
                close_roles((scheduler.step_loop.verifier, scheduler.step_loop.drafter))


def close_roles(roles) -> None:
    """Close the role clients' streams (RemoteVerifier, RemoteDrafter; in-process roles have nothing to close):
    a remote role whose open stream is cancelled when the router goes logs an error."""
    for role in roles:
        close = getattr(role, "close", None)
        if close is not None:
            close()


async def start_router(step_loops: Sequence[StepLoop], facts: ModelFacts, host: str = "127.0.0.1", port: int = 0,
                       metrics: RouterMetrics | None = None, api_keys: ApiKeys | None = None,
                       limits: TenantLimits | None = None, tls: ServerTls | None = None,
                       routing: RoutingConfig = RoutingConfig()) -> RouterServer:
    """Serve the replicas' step loops on host:port (0 = a free port); health is SERVING once up. With api_keys,
    every method but health needs one of them (common/wire/auth.py); limits: each tenant's rate limits. With tls the port
    speaks TLS (mutual with a client CA), and a Unix socket of this user's (`loopback`) serves this process's HTTP
    front. routing: which replica takes a new request (server.routing)."""
    version = await start_version(step_loops, facts, metrics, routing)
    service = GenerationService(version, api_keys=api_keys, limits=limits)
    loopback = loopback_socket() if tls is not None else None
    server, health_servicer, bound = await start_server(
        lambda s: register_generation(service, s), (SERVICE_NAME,), host, port, loopback,
        interceptors=(AuthInterceptor(api_keys),) if api_keys else (),
        credentials=tls.grpc_credentials() if tls is not None else None)
    log.info("router listening on %s:%d%s", host, bound, " (TLS)" if tls is not None else "")
    return RouterServer(server, health_servicer, bound, service, f"unix:{loopback}" if loopback else None)


async def start_version(step_loops: Sequence[StepLoop], facts: ModelFacts, metrics: RouterMetrics | None,
                        routing: RoutingConfig = RoutingConfig()) -> Version:
    """A serving version over its replicas' step loops, each stepping from now on; facts.version names it."""
    at = metrics.at(facts.version) if metrics is not None else None
    schedulers = [Scheduler(loop, at, replica=i) for i, loop in enumerate(step_loops)]
    for scheduler in schedulers:
        await scheduler.start()
    # the router remembers as many blocks a replica as its verifier's cache holds
    cache = ((step_loops[0].verifier.block_size, step_loops[0].verifier.num_blocks) if step_loops
             else (BLOCK_TOKENS, DEFAULT_CAPACITY_BLOCKS))
    return Version(facts, schedulers, metrics=at, routing=prefix_router(routing, *cache))


def loopback_socket() -> str:
    """The router's own Unix socket, in the temp directory with the roles' (cleaned up with theirs)."""
    return os.path.join(tempfile.gettempdir(), f"blockspec-{os.getpid()}-router.sock")


def register_generation(service: GenerationService, server: grpc.aio.Server) -> None:
    """Like the generated add_GenerationServicer_to_server, but a request that does not parse (e.g. invalid
    UTF-8 in a string field) reaches the servicer as a DecodeError, to be answered INVALID_ARGUMENT
    instead of grpc's generic INTERNAL."""
    def tolerant(message_cls):
        def parse(data: bytes):
            try:
                return message_cls.FromString(data)
            except DecodeError as e:
                return e
        return parse

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate, request_deserializer=tolerant(api_pb2.GenerateRequest),
            response_serializer=api_pb2.GenerateResponse.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            service.ModelInfo, request_deserializer=tolerant(api_pb2.ModelInfoRequest),
            response_serializer=api_pb2.ModelInfoResponse.SerializeToString),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize, request_deserializer=tolerant(api_pb2.TokenizeRequest),
            response_serializer=api_pb2.TokenizeResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
