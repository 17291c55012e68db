"""The router's side of `blockspec serve` once the roles serve: the router, the fleet of versions (blue/green rollouts,
services/serving/rollout.py), the autoscaler, the management port, and the supervisor loop over every version's
role processes, until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from blockspec.common.config import AutoscalingConfig, BlockspecConfig
from blockspec.common.wire.auth import ApiKeys
from blockspec.common.wire.tls import ServerTls
from blockspec.services.serving.admin import start_admin
from blockspec.services.serving.autoscaler import Autoscaler, replica_loop
from blockspec.services.serving.rollout import Fleet, ServedVersion

log = logging.getLogger(__name__)

DRAFTER_RETRY_S = 10.0  # a drafter that failed to restart is tried again after this long


async def route(cfg: BlockspecConfig, router_over: Callable, http_port: int, state: dict, keys: ApiKeys | None,
                tls: ServerTls | None, readiness: Callable, starter: Callable | None = None,
                startup: Callable | None = None) -> int:
    """The router (from `router_over`) over the started roles (state["replicas"]), supervised until SIGTERM/SIGINT.
    starter(cfg, prefix) -> start_replica(index): how this server starts a version's replicas (None: it cannot;
    no autoscaling, no rollout); startup: startup.resolve_startup, for a rollout's config."""
    replicas = state["replicas"]
    router = await router_over(replicas, keys, tls)
    state["router"] = router
    start_replica = starter(cfg, "") if starter is not None else None
    fleet = Fleet(router, ServedVersion(cfg, start_replica, replica_loop(cfg), pairs=replicas), starter, replica_loop, startup)
    state["fleet"] = fleet
    admin = start_admin(cfg.server.admin, fleet, asyncio.get_running_loop()) if cfg.server.admin else None
    if admin is not None:
        print(f"ADMIN {admin.server_port}", flush=True)
    print(f"SERVING grpc={router.port} http={http_port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    fixed = AutoscalingConfig(min_replicas=cfg.server.replicas, max_replicas=cfg.server.replicas)
    autoscaler = Autoscaler(cfg.server.autoscaling or fixed, router, fleet) if start_replica is not None else None
    state["autoscaler"] = autoscaler  # /health reads which lost replicas are being replaced
    try:
        return await supervise(fleet, stop, router, readiness, autoscaler)
    finally:
        if admin is not None:
            admin.shutdown()
        if autoscaler is not None:
            await autoscaler.close()
        await fleet.close()
        await router.stop(1)


async def supervise(fleet: Fleet, stop: asyncio.Event, router, readiness, autoscaler=None) -> int:
    """Every second until `stop`: restart a drafter that exited (if that fails, its requests go on at k=0 and it is
    tried again DRAFTER_RETRY_S later); a verifier that exited: in the active version with other replicas and an
    autoscaler (role processes), its replica is replaced while the others serve; in another version (a candidate, or
    the previous one in its grace period) that replica is dropped; else the server stops with exit code 1 (a
    supervisor such as systemd's Restart=on-failure starts it again); the router's gRPC health follows /health's
    readiness; the autoscaler starts or drains the active version's replicas as the queue asks."""
    retry_at: dict[int, float] = {}
    while not stop.is_set():
        if autoscaler is not None:
            await autoscaler.step()
        for served, pair in fleet.pairs():
            verifier, drafter = pair
            if drafter is not None and not drafter.alive() and time.monotonic() >= retry_at.get(id(drafter), 0.0):
                try:
                    await asyncio.to_thread(drafter.restart)
                except Exception as e:  # noqa: BLE001 - whatever kept it from starting: serve on at k=0
                    log.error("restarting a drafter failed (%s); its requests continue at k=0; retrying in %.0f s",
                              e, DRAFTER_RETRY_S)
                    retry_at[id(drafter)] = time.monotonic() + DRAFTER_RETRY_S
            if not await asyncio.to_thread(verifier.alive) and pair in served.pairs:  # not scaled down meanwhile
                if served is not fleet.active:
                    fleet.lost(served, pair)
                    continue
                if autoscaler is not None and len(served.pairs) > 1:  # the others serve on; it is replaced
                    autoscaler.lost(pair)
                    continue
                log.error("a verifier role exited; stopping (exit code 1)")
                return 1
        await router.set_serving((await asyncio.to_thread(readiness)).serving)
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass
    return 0
