"""TLS for the public ports and the role hops, on the ssl and grpc libraries' own mechanisms.

A server's certificate files are read again when they change, without a restart: the HTTP port picks the newest
context at each handshake (ssl's SNI callback, asked for every connection), the gRPC ports by grpc's dynamic
credentials (asked for every handshake). A connection already open keeps the certificate it started with.

Role hops over TCP use mutual TLS where BLOCKSPEC_ROLE_TLS_CERT, _KEY and _CA are set (`serve` sets them from
`server.role_tls` for the roles it starts): a role accepts only a caller whose certificate that CA signed, and the
router presents the same certificate and checks the role's against the CA. Unix sockets stay plaintext, owner-only.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import Counter

from blockspec.common.errors import InvalidArgument

log = logging.getLogger(__name__)

ENV_ROLE_TLS = {"cert": "BLOCKSPEC_ROLE_TLS_CERT", "key": "BLOCKSPEC_ROLE_TLS_KEY", "ca": "BLOCKSPEC_ROLE_TLS_CA"}
CHECK_EVERY_S = 1.0  # a server looks at its files' change times at most this often
VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}

HANDSHAKE_FAILURES = Counter("blockspec_tls_handshake_failures_total",
                             "TLS handshakes the HTTP port refused (plaintext, an unknown CA, no or an expired client "
                             "certificate), by reason", ["port", "reason"])


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(what, f"cannot read {path}: {e.strerror}") from None


def _stamp(paths) -> tuple:
    """What tells a file changed: its change time, size and inode (a rename over it, as cert-manager does)."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class ServerTls:
    """A server's certificate chain and key, and with client_ca a CA whose certificates it requires of every client
    (mutual TLS). min_version: "1.2" or "1.3" (HTTP; grpc's floor is 1.2 whatever is set)."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None = None, min_version: str = "1.2",
                 field: str = "server.tls") -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self.min_version, self.field = min_version, field
        self._lock = threading.Lock()
        self._checked = 0.0
        self._stamp = _stamp(self._paths)
        self._context = self._build_context()  # raises InvalidArgument on a bad file: at start, not at a handshake
        self._grpc_stamp = self._stamp

    @property
    def _paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def _build_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = VERSIONS[self.min_version]
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgument(f"{self.field}.cert_file", f"{self.cert_file} with key {self.key_file}: {e}") from None
        if self.client_ca_file:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except (OSError, ssl.SSLError) as e:
                raise InvalidArgument(f"{self.field}.client_ca_file", f"{self.client_ca_file}: {e}") from None
            ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.sni_callback = self._pick
        return ctx

    def _changed(self) -> bool:
        """Whether the files changed since the last look (looked at no more than once per CHECK_EVERY_S)."""
        now = time.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return False
        self._checked = now
        stamp = _stamp(self._paths)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True

    def context(self) -> ssl.SSLContext:
        """The SSLContext of the newest readable files: a rotation half written (a key not matching its certificate)
        keeps the last good one and says so."""
        with self._lock:
            if self._changed():
                try:
                    self._context = self._build_context()
                    log.info("%s: certificate files changed; new connections use them", self.field)
                except InvalidArgument as e:
                    log.warning("%s: certificate files changed but do not load (%s); keeping the previous ones",
                                self.field, e.message)
            return self._context

    def _pick(self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        """Asked at each handshake (with or without SNI): the newest context serves it."""
        sslobj.context = self.context()

    def refused(self, port: str, peer, error: BaseException) -> None:
        """A handshake that failed: counted by reason and logged with the peer."""
        reason = getattr(error, "reason", None) or type(error).__name__
        HANDSHAKE_FAILURES.labels(port, str(reason)).inc()
        log.warning("%s: TLS handshake from %s refused: %s", port, _peer(peer), reason)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """grpc's dynamic server credentials over the same files: each handshake asks for changes first."""
        return grpc.dynamic_ssl_server_credentials(self._grpc_config(), self._grpc_fetch,
                                                   require_client_authentication=self.mutual)

    def _grpc_config(self):
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key_file, f"{self.field}.key_file"), _read(self.cert_file, f"{self.field}.cert_file"))],
            _read(self.client_ca_file, f"{self.field}.client_ca_file") if self.client_ca_file else None)

    def _grpc_fetch(self):
        """None: no change. Files that changed and load (the same check as HTTP's) give a new configuration."""
        stamp = _stamp(self._paths)
        if stamp == self._grpc_stamp:
            return None
        try:
            self._build_context()
            config = self._grpc_config()
        except InvalidArgument as e:
            log.warning("%s: certificate files changed but do not load (%s); gRPC keeps the previous ones",
                        self.field, e.message)
            return None
        self._grpc_stamp = stamp
        return config


def _peer(peer) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return str(peer)


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (ca_file; None: the system's roots) and, for mutual TLS, the certificate it presents."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "--tls-ca") if self.ca_file else None,
            private_key=_read(self.key_file, "--tls-key") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "--tls-cert") if self.cert_file else None)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


def role_server_tls() -> ServerTls | None:
    """A role's mutual TLS from the environment (all three variables, or none)."""
    values = {name: os.environ.get(var) for name, var in ENV_ROLE_TLS.items()}
    if not any(values.values()):
        return None
    missing = [ENV_ROLE_TLS[name] for name, value in values.items() if not value]
    if missing:
        raise InvalidArgument(missing[0], f"role TLS needs {', '.join(ENV_ROLE_TLS.values())} together")
    return ServerTls(values["cert"], values["key"], values["ca"], field="server.role_tls")


def role_client_tls() -> ClientTls | None:
    """The router's side of the role hops: the roles' CA, and the same certificate presented as the client's."""
    values = {name: os.environ.get(var) for name, var in ENV_ROLE_TLS.items()}
    if not all(values.values()):
        return None
    return ClientTls(values["ca"], values["cert"], values["key"])


def secure_channel(address: str, tls: ClientTls | None, options=()) -> grpc.Channel:
    """A channel to address: TLS with `tls`, plaintext without (and always to a Unix socket)."""
    if tls is None or address.startswith("unix:"):
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.grpc_credentials(), options=options)


def http_url(where: str, tls: ClientTls | None) -> tuple[str, object]:
    """(the URL of HOST:PORT's HTTP port, the ssl context to open it with or None) for a client's `tls`."""
    return (f"https://{where}", tls.ssl_context()) if tls is not None else (f"http://{where}", None)
