"""The replicas of `serve --no-ray`: role pairs started and drained as the queue asks (server.autoscaling; the
policy is services/router/autoscale.py), and a replica whose verifier died replaced while the others serve on. A new
replica takes requests once both its roles have loaded and the router has connected to them; a replica scaled down
takes no new request, finishes its streams, then its roles stop. Without server.autoscaling the bounds are
server.replicas both ways: only lost replicas are replaced."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from blockspec.common.config import AutoscalingConfig, BlockspecConfig
from blockspec.services.router.app import RouterServer
from blockspec.services.router.autoscale import QueuePolicy
from blockspec.services.router.step_loop import StepLoop
from blockspec.services.serving.launch import connect_roles
from blockspec.services.serving.rollout import Fleet

log = logging.getLogger(__name__)


class Autoscaler:
    """Asked once a second by serve's supervisor; it scales the fleet's active version (services/serving/rollout.py),
    whose start_replica(index) starts one more role pair (blocking, until both serve) and make_loop(pair) connects
    the router's clients to one."""

    def __init__(self, cfg: AutoscalingConfig, router: RouterServer, fleet: Fleet) -> None:
        self.policy = QueuePolicy(cfg)
        self.router, self.fleet = router, fleet
        self.starting = 0
        self.tasks: set[asyncio.Task] = set()
        # Replicas lost with their verifier whose capacity is not back: /health says degraded, naming them, until a
        # replica started after the loss is ready, or the policy wants no replacement (nothing starting).
        self.replacing: list[str] = []

    @property
    def live(self) -> int:
        """Replicas serving or starting; draining ones do not count."""
        return len(self.router.schedulers) - len(self.router.draining) + self.starting

    async def step(self) -> None:
        waiting, live = self.router.waiting, self.live
        decision = self.policy.decide(waiting, live, time.monotonic())
        if decision is not None:
            log.info("autoscaling: %d -> %d replicas: %s", live, decision.replicas, decision.reason)
            for _ in range(decision.replicas - live):
                self.starting += 1  # counted from now: the step's own checks below see it
                self._spawn(self._up())
            if decision.replicas < live:
                self._spawn(self._down())
        if self.replacing and not self.starting:  # no replacement wanted: the capacity is what the policy asks
            log.info("autoscaling: replica %s is not replaced (%d replicas serve, as the queue asks)",
                     ", ".join(self.replacing), live)
            self.replacing.clear()
        self._gauges(waiting, decision.replicas if decision is not None else None)

    def _gauges(self, waiting: int, desired: int | None) -> None:
        m = self.router.metrics
        if m is None:
            return
        m.autoscale_waiting.set(waiting)
        if desired is not None:
            m.replicas.labels(state="desired").set(desired)
        elif not self.tasks:
            m.replicas.labels(state="desired").set(self.live)
        m.replicas.labels(state="ready").set(len(self.router.schedulers) - len(self.router.draining))
        m.replicas.labels(state="starting").set(self.starting)
        m.replicas.labels(state="draining").set(len(self.router.draining))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _up(self) -> None:
        served = self.fleet.active
        index, served.next_index = served.next_index, served.next_index + 1
        try:
            pair = await asyncio.to_thread(served.start_replica, index)
            if served.state not in ("live", "grace"):  # rolled back or retired meanwhile
                for role in pair:
                    if role is not None:
                        await asyncio.to_thread(role.stop)
                return
            served.pairs.append(pair)  # watched by the supervisor from now on, and stopped with its version
            loop = await asyncio.to_thread(served.make_loop, pair)
            scheduler = await self.router.add_replica(loop, served.version)
            served.roles[id(scheduler)] = pair
            replaced = f" in place of replica {self.replacing.pop(0)}" if self.replacing else ""
            log.info("autoscaling: replica %s is ready and takes requests%s (version %s)", scheduler.replica, replaced,
                     served.name)
        except Exception as e:  # noqa: BLE001 - a replica that did not start: the policy asks again
            log.error("autoscaling: starting a replica failed (%s)", e)
        finally:
            self.starting -= 1
            self._gauges(self.router.waiting, None)  # the ready count as /health sees it, not a step later

    async def _down(self) -> None:
        served = self.fleet.active
        version = served.version
        open_ = [s for s in version.schedulers if s not in version.draining]
        if len(open_) <= self.policy.cfg.min_replicas:
            return
        scheduler = min(open_, key=lambda s: (s.load, -int(s.replica)))  # the least loaded, the newest first
        log.info("autoscaling: replica %s drains (%d streams to finish)", scheduler.replica, scheduler.load)
        await self.router.drain(scheduler, version=version)
        pair = served.roles.pop(id(scheduler))
        served.pairs.remove(pair)  # before its roles stop: the supervisor no longer watches them
        for role in pair:
            if role is not None:
                await asyncio.to_thread(role.stop)
        log.info("autoscaling: replica %s stopped", scheduler.replica)

    def lost(self, pair: tuple) -> None:
        """A replica of the active version whose verifier process is gone: out of its pairs now (the supervisor no
        longer watches it); it takes no new request, its requests end UNAVAILABLE (the step that finds the verifier
        gone fails them), its drafter stops, and the policy replaces it (below min_replicas: at once)."""
        served = self.fleet.active
        scheduler = next(s for s in served.version.schedulers if served.roles.get(id(s)) is pair)
        log.error("replica %s lost its verifier: its requests end UNAVAILABLE; the other replicas serve on and a new "
                  "one replaces it", scheduler.replica)
        served.pairs.remove(pair)
        del served.roles[id(scheduler)]
        served.version.draining.add(scheduler)  # from now on, before the drain task runs
        self.replacing.append(scheduler.replica)
        self._gauges(self.router.waiting, None)
        self._spawn(self._remove(scheduler, pair, served.version))

    async def _remove(self, scheduler, pair: tuple, version) -> None:
        await self.router.drain(scheduler, version=version)
        for role in pair:
            if role is not None:
                await asyncio.to_thread(role.stop)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def replica_loop(cfg: BlockspecConfig) -> Callable[[tuple], StepLoop]:
    """The router's step loop over a started (verifier, drafter) pair, with the config's settings."""
    spec = cfg.model.spec_decode

    def make(pair: tuple) -> StepLoop:
        verifier, drafter = pair
        v, d = connect_roles(verifier.address, (lambda: drafter.address) if drafter is not None else None)
        return StepLoop(v, d, cfg.server.max_batch, spec.adaptive_k, cfg.server.prefill_chunk_tokens,
                        spec.prompt_lookup, spec.prompt_lookup_tokens)

    return make
