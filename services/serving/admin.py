"""The management port (server.admin): the rollout commands over HTTP, for `blockspec rollout` and curl. Every call
needs `Authorization: Bearer <admin key>`; the port binds server.admin.host (loopback by default), apart from the
public ports.

  GET  /v1/rollout            the versions and their states
  POST /v1/rollout            body: the new version's config (YAML) -> 202, its roles start and its checks run
  POST /v1/rollout/promote    the checked candidate takes every new request
  POST /v1/rollout/rollback   new requests go back to the previous version (or the candidate is withdrawn)

Each answer is the status object (JSON); an error is {"error": {"message", "field"}} with 400 (a bad config, naming
the key), 401 (no or another key) or 409 (not possible now: the message says why)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from blockspec.common.config import AdminConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.wire.grpc_server import BindError
from blockspec.services.router.http import HttpServer
from blockspec.services.serving.rollout import Fleet, RolloutError

log = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
MAX_CONFIG_BYTES = 1 << 20


def load_admin_key(path: str) -> str:
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument("server.admin.key_file", f"{path}: cannot read it ({e})") from None
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key) or not key.isprintable():
        raise InvalidArgument("server.admin.key_file", f"{path}: one key of at least {MIN_KEY_CHARS} printable "
                                                       "characters, no spaces")
    return key


def _error(status: int, message: str, field: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="blockspec-admin"'} if status == 401 else None
    return JSONResponse({"error": {"message": message, "field": field}}, status, headers=headers)


def admin_app(fleet: Fleet, loop: asyncio.AbstractEventLoop, key: str) -> Starlette:
    """The routes above; each command runs on the router's event loop (`loop`), where the fleet lives."""
    expected = f"Bearer {key}".encode()

    async def on_router(coro) -> object:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def guarded(handler):
        async def endpoint(request: Request):
            given = request.headers.get("authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(given, expected):
                log.warning("admin: refused a call from %s: no admin key, or another one", request.client)
                return _error(401, "Authorization: Bearer <the admin key> is needed here")
            try:
                return await handler(request)
            except InvalidArgument as e:
                return _error(400, str(e), e.field)
            except RolloutError as e:
                return _error(409, str(e))

        return endpoint

    async def status(_request: Request):
        return JSONResponse(await on_router(_status(fleet)))

    async def start(request: Request):
        body = await request.body()
        if len(body) > MAX_CONFIG_BYTES:
            raise InvalidArgument("config", f"{len(body)} bytes; at most {MAX_CONFIG_BYTES}")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument("config", f"not UTF-8 text (byte {e.start})") from None
        log.info("admin: rollout start from %s", request.client)
        return JSONResponse(await on_router(fleet.start(text)), 202)

    async def promote(request: Request):
        log.info("admin: promote from %s", request.client)
        return JSONResponse(await on_router(fleet.promote()))

    async def rollback(request: Request):
        log.info("admin: rollback from %s", request.client)
        return JSONResponse(await on_router(fleet.rollback()))

    return Starlette(routes=[
        Route("/v1/rollout", guarded(status), methods=["GET"]),
        Route("/v1/rollout", guarded(start), methods=["POST"]),
        Route("/v1/rollout/promote", guarded(promote), methods=["POST"]),
        Route("/v1/rollout/rollback", guarded(rollback), methods=["POST"]),
    ])


async def _status(fleet: Fleet) -> dict:
    return fleet.status()


def start_admin(cfg: AdminConfig, fleet: Fleet, loop: asyncio.AbstractEventLoop) -> HttpServer:
    """The management port, serving in a daemon thread (server_port: the bound port)."""
    key = load_admin_key(cfg.key_file)
    try:
        sock = socket.create_server((cfg.host, cfg.port), family=socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    except OSError as e:
        raise BindError(f"cannot bind {cfg.host}:{cfg.port} for the management port ({e.strerror or e})") from None
    server = HttpServer(admin_app(fleet, loop, key), sock)
    log.info("management port on %s:%d (blockspec rollout)", cfg.host, server.server_port)
    return server
