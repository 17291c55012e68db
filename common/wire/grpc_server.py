"""Start a grpc.aio server with our services, grpc.health.v1 and server reflection: the same for every role."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE = 64 * 1024 * 1024


class BindError(OSError):
    """A port or socket that cannot be bound (taken by another process): `serve` says so in one line, exit 1."""


async def start_server(
    register: Callable[[grpc.aio.Server], None], service_names: Sequence[str], host: str, port: int,
    unix_socket: str | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Bind host:port (0 = any free port; TLS with `credentials`) and the Unix domain socket at `unix_socket` where
    given (plaintext, owner-only; grpc removes the file when the server stops, and a stale one when it binds),
    register the services, mark them SERVING; returns the bound port. `interceptors` see every call first (the
    router's API keys)."""
    # SO_REUSEPORT off (grpc turns it on): a second server on a taken port fails to bind instead of silently
    # sharing the port, the kernel splitting the clients between the two.
    server = grpc.aio.server(interceptors=tuple(interceptors), options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                      ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.so_reuseport", 0)])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = _bind(server, f"{host}:{port}", credentials)
    if unix_socket:
        _bind(server, f"unix:{unix_socket}")
    await server.start()
    if unix_socket:
        os.chmod(unix_socket, 0o600)  # only this user's processes connect
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """The bound port; an address that cannot be bound (taken, not ours) is a BindError naming it."""
    try:
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc's "Failed to bind to address"
        bound = 0
    if bound == 0:
        raise BindError(f"cannot bind {address} ({bind_problem(address)})")
    return bound


def bind_problem(address: str) -> str:
    """Why HOST:PORT or unix:PATH cannot be bound, as the system says it (grpc does not): a bind attempt of
    our own, e.g. "Address already in use", "Cannot assign requested address" (a host not of this machine)."""
    if address.startswith("unix:"):
        directory = os.path.dirname(os.path.abspath(address[5:]))
        return "no such directory" if not os.path.isdir(directory) else "the socket path cannot be bound"
    host, _, port = address.rpartition(":")
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(where)
    except OSError as e:  # socket.gaierror too: a host name that does not resolve
        return str(e.strerror or e)
    return "grpc refused it"


def check_bindable(host: str, port: int) -> None:
    """Refuse a taken or foreign HOST:PORT before anything slow starts (a server checks its public port before it
    loads models); the bind itself still reports what changes meanwhile. Port 0 (any free one) always binds."""
    if not port:
        return
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds: a port in TIME_WAIT is free
            probe.bind(where)
    except OSError as e:
        raise BindError(f"cannot bind {address} ({e.strerror or e})") from None
