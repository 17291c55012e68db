"""Which API a server's port speaks, so that a client given the other port says so in one line: `--server` takes the
gRPC API's HOST:PORT (HTTP/2, `server.grpc_port`), `--http` the HTTP port's (HTTP/1.1: /health, /metrics, /v1)."""

from __future__ import annotations

import socket

from blockspec.common.errors import InvalidArgument

GRPC, HTTP = "gRPC", "HTTP"
PROBE_TIMEOUT_S = 5.0
# What takes each port, for the message that names the other one.
_TAKEN_BY = {GRPC: "the gRPC port (server.grpc_port, default 8001) goes to --server of generate, bench and validate",
             HTTP: "the HTTP port (server.port, default 8000) goes to --http of batch and validate"}


def speaks(address: str, tls=None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """GRPC or HTTP: what HOST:PORT answers an HTTP/1.1 `GET /health` with - a status line (HTTP), or the HTTP/2
    SETTINGS frame a gRPC server opens with. Over TLS (`tls`: a common/wire/tls.ClientTls) a gRPC server answers
    HTTP/1.1 with nothing: a port that does not, and takes HTTP/2 when only that is offered (ALPN), is gRPC. None
    where it cannot tell: no answer, a TLS handshake that fails, a Unix socket, other bytes."""
    if address.startswith("unix:"):
        return None
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    _, first = _exchange(host, int(port), address, tls, "http/1.1", timeout)
    if first.startswith(b"HTTP/"):
        return HTTP
    # An HTTP/2 frame header: 3 bytes of length, type 4 (SETTINGS), flags, stream 0.
    if len(first) == 9 and first[3] == 0x04 and first[5:] == b"\0\0\0\0":
        return GRPC
    if tls is not None and _exchange(host, int(port), address, tls, "h2", timeout)[0] == "h2":
        return GRPC
    return None


def _exchange(host: str, port: int, address: str, tls, alpn: str, timeout: float) -> tuple[str | None, bytes]:
    """(the protocol TLS agreed on, the first 9 bytes of the answer to `GET /health`); on an error (None, what came)."""
    data = b""
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, _wrap(raw, host, tls, alpn) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode())
            while len(data) < 9:
                chunk = sock.recv(9 - len(data))
                if not chunk:
                    break
                data += chunk
            return (sock.selected_alpn_protocol() if tls is not None else None), data
    except OSError:  # refused, reset, timed out, TLS (ssl.SSLError is an OSError)
        return None, data


def _wrap(raw: socket.socket, host: str, tls, alpn: str) -> socket.socket:
    if tls is None:
        return raw
    context = tls.ssl_context()
    context.set_alpn_protocols([alpn])
    return context.wrap_socket(raw, server_hostname=host)


def check_speaks(flag: str, address: str, expected: str, tls=None) -> None:
    """Refuse (InvalidArgument on `flag`) an address that speaks the other API than `expected`; nothing where it
    speaks `expected` or cannot be told (the client's own error says what happened then)."""
    got = speaks(address, tls)
    if got is not None and got != expected:
        raise InvalidArgument(flag, f"{address} speaks {got}, not {expected}: {flag} takes the server's {expected} "
                                    f"port; {_TAKEN_BY[got]}")
