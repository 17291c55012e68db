"""API keys: who may call the router. One check guards every gRPC method and every HTTP route; what it does
not name as open (health) is denied without a known key. Keys are compared in constant time.

The server reads its keys from `server.api_keys_file`; a client sends one as `authorization: Bearer KEY`
(gRPC metadata or HTTP header). `blockspec generate --server` and `bench --server` send $BLOCKSPEC_API_KEY.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
from pathlib import Path

import grpc

from blockspec.common.errors import InvalidArgument

ENV_API_KEY = "BLOCKSPEC_API_KEY"  # the key the CLI's clients send, where set
DEFAULT_TENANT = "default"  # a key listed alone, and every caller of a server without keys
ENV_ROLE_KEY = "BLOCKSPEC_ROLE_KEY"  # the key the roles require of their caller (the router), where set
MIN_KEY_LEN = 16  # shorter keys are refused: guessable
OPEN_GRPC_METHODS = frozenset(f"/grpc.health.v1.Health/{m}" for m in ("Check", "Watch", "List"))
OPEN_HTTP_PATHS = frozenset({"/health"})
DENIED = "missing or unknown API key: send 'authorization: Bearer <key>'"


class ApiKeys:
    """Known keys and the tenant each belongs to; `tenant` finds a presented key's in constant time."""

    def __init__(self, keys: dict[str, str]) -> None:  # key -> tenant
        self._digests = [(_digest(key), tenant) for key, tenant in keys.items()]
        self.tenants = frozenset(keys.values())

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        """One key a line, `KEY` or `TENANT KEY`; blank lines and `#` comments skipped. ValueError names the
        line at fault (the config names the key)."""
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e.strerror}") from None
        keys: dict[str, str] = {}
        for number, line in enumerate(lines, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            if len(fields) > 2:
                raise ValueError(f"{path}:{number}: expected KEY or TENANT KEY, got {len(fields)} fields")
            tenant, key = fields if len(fields) == 2 else (DEFAULT_TENANT, fields[0])
            if len(key) < MIN_KEY_LEN:
                raise ValueError(f"{path}:{number}: a key must have at least {MIN_KEY_LEN} characters")
            if key in keys:
                raise ValueError(f"{path}:{number}: the key is listed twice")
            keys[key] = tenant
        if not keys:
            raise ValueError(f"{path} holds no key (every call would be denied)")
        return cls(keys)

    def caller(self, metadata) -> str | None:
        """The tenant of a call's gRPC metadata ((key, value) pairs), or None."""
        return self.tenant(next((v for k, v in metadata or () if k == "authorization" and isinstance(v, str)), None))

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of the key in an `authorization: Bearer KEY` value, or None. Every known key is compared
        (no early exit), each as a digest of the same length: the time does not tell which key came near."""
        if not authorization or not authorization[:7].lower() == "bearer ":
            return None
        presented, found = _digest(authorization[7:].strip()), None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method but health needs a known key; anything else is UNAUTHENTICATED before it runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_GRPC_METHODS:
            return handler
        if self.keys.caller(details.invocation_metadata) is not None:
            return handler
        return _denied(handler)


async def _deny(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[handler.request_streaming, handler.response_streaming](
        _deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


CHALLENGE = ("WWW-Authenticate", 'Bearer realm="blockspec"')


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                         "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _KeyMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, key: str) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),)

    def _with_key(self, d):
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), *self.metadata), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_key(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_key(details), requests)


def client_channel(address: str, key: str | None = None, tls=None) -> grpc.Channel:
    """A channel to a router that sends `key` (default: $BLOCKSPEC_API_KEY, where set) with every call; over TLS
    with `tls` (a common.tls.ClientTls)."""
    from blockspec.common.wire.tls import secure_channel

    channel = secure_channel(address, tls)
    key = key if key is not None else os.environ.get(ENV_API_KEY)
    return grpc.intercept_channel(channel, _KeyMetadata(key)) if key else channel


def role_interceptors() -> tuple[grpc.aio.ServerInterceptor, ...]:
    """A role's server: with $BLOCKSPEC_ROLE_KEY set, every method but health needs it."""
    key = os.environ.get(ENV_ROLE_KEY)
    if not key:
        return ()
    if len(key) < MIN_KEY_LEN:
        raise InvalidArgument(ENV_ROLE_KEY, f"must have at least {MIN_KEY_LEN} characters")
    return (AuthInterceptor(ApiKeys({key: "router"})),)


def role_channel(address: str, key: str | None = None) -> grpc.Channel:
    """The router's channel to a role: sends `key` (default: $BLOCKSPEC_ROLE_KEY, where set), over mutual TLS where
    BLOCKSPEC_ROLE_TLS_* are set (common/wire/tls.py) and the address is TCP."""
    from blockspec.common.wire.tls import role_client_tls

    return client_channel(address, os.environ.get(ENV_ROLE_KEY, "") if key is None else key, role_client_tls())


def ensure_role_key() -> None:
    """A server that starts its own roles makes up their key where the operator set none; the roles inherit it."""
    if not os.environ.get(ENV_ROLE_KEY):  # unset, or set empty (compose's ${BLOCKSPEC_ROLE_KEY:-})
        os.environ[ENV_ROLE_KEY] = secrets.token_urlsafe(32)
