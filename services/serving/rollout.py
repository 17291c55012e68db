"""Blue/green rollouts: the versions one server runs, and how new requests move between them.

A `ServedVersion` is one version (a model pair and its settings) over its own replicas as the supervisor runs it;
services/router/server.Version is the router's side of the same version. New requests go to the active version.
`start` brings a candidate up beside it - its roles load, then the go-live checks (golive.py: ready, speculative ==
plain on the check prompts, the throughput ratio) run against it on an owner-only Unix socket; `promote` makes it
the active one in one assignment, and the old version keeps its replicas for server.admin.rollout_grace_s (its
streams finish; `rollback` is the same assignment back), then stops. A stream stays with the version it arrived at,
so its tokens come from exactly one version."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from blockspec.common.config import BlockspecConfig, load_yaml, parse_config
from blockspec.common.errors import InvalidArgument
from blockspec.services.router.app import SERVICE_NAME, RouterServer, register_generation, start_version
from blockspec.services.router.server import GenerationService, Version
from blockspec.services.router.step_loop import StepLoop

log = logging.getLogger(__name__)

# The keys of a new version's config: its model section, and these of server (the rest belongs to the running server).
VERSION_SERVER_KEYS = frozenset({"max_batch", "prefill_chunk_tokens"})


class RolloutError(Exception):
    """A rollout command that cannot be carried out now (HTTP 409), with the reason."""


@dataclass(eq=False)
class ServedVersion:
    """One version's replicas and how to add more. `pairs`: its (verifier, drafter) role pairs; `roles`: each
    replica's pair by id of its scheduler; start_replica(index) starts one more pair (blocking); make_loop(pair)
    connects the router to a pair."""

    cfg: BlockspecConfig
    start_replica: Callable[[int], tuple] | None
    make_loop: Callable[[tuple], StepLoop] | None
    version: Version | None = None  # the router's side, once the roles serve
    pairs: list = field(default_factory=list)
    roles: dict = field(default_factory=dict)
    state: str = "live"  # starting, checking, ready, failed | live | grace | retiring
    checks: list = field(default_factory=list)  # golive.Check objects
    error: str = ""
    since: float = field(default_factory=time.time)
    grace_until: float | None = None
    next_index: int = 0
    candidate_socket: str | None = None  # where the checks reach it before it is promoted
    check_server: object | None = None  # the gRPC server on candidate_socket

    @property
    def name(self) -> str:
        return self.cfg.version

    def replica_name(self, pair: tuple) -> str:
        """The router's name of the replica over `pair` (its scheduler's, as in metrics and logs); its index among
        the pairs before the router has one."""
        schedulers = self.version.schedulers if self.version is not None else ()
        return next((s.replica for s in schedulers if self.roles.get(id(s)) is pair), str(self.pairs.index(pair)))

    def status(self) -> dict:
        v = self.version
        out = {"version": self.name, "state": self.state, "since": round(self.since, 3),
               "target": self.cfg.model.target_model_path, "drafter": self.cfg.model.draft_model_path,
               "replicas": len(v.schedulers) if v else 0, "streams": v.load if v else 0}
        if self.grace_until is not None:
            out["grace_left_s"] = round(max(0.0, self.grace_until - time.time()), 1)
        if self.checks:
            out["checks"] = [asdict(c) for c in self.checks]
        if self.candidate_socket:
            out["check_address"] = f"unix:{self.candidate_socket}"
        if self.error:
            out["error"] = self.error
        return out


class Fleet:
    """The versions of one server: `active` (new requests), at most one candidate and at most one previous version
    in its grace period. Its methods run on the router's event loop. starter(cfg, prefix) returns start_replica for
    another version's config (None: this server cannot start roles, and `start` is refused); startup(cfg) checks a
    config and resolves its method (startup.resolve_startup)."""

    def __init__(self, router: RouterServer, active: ServedVersion,
                 starter: Callable[[BlockspecConfig, str], Callable[[int], tuple]] | None = None,
                 make_loop: Callable[[BlockspecConfig], Callable[[tuple], StepLoop]] | None = None,
                 startup: Callable | None = None) -> None:
        self.router, self.active = router, active
        self.versions = [active]
        self.starter, self.loop_for, self.startup = starter, make_loop, startup
        self.tasks: set[asyncio.Task] = set()
        self.switched_at: float | None = None  # time.monotonic() of the last promote or rollback
        active.version = router.service.version
        # --inprocess: a replica and no role pair (its engine runs in this process)
        active.roles = {id(s): pair for s, pair in zip(active.version.schedulers, active.pairs, strict=False)}
        active.next_index = len(active.pairs)

    @property
    def admin(self):
        return self.active.cfg.server.admin

    def pairs(self) -> list[tuple[ServedVersion, tuple]]:
        return [(r, pair) for r in self.versions for pair in list(r.pairs)]

    def _with(self, *states: str) -> ServedVersion | None:
        return next((r for r in self.versions if r is not self.active and r.state in states), None)

    def status(self) -> dict:
        return {"active": self.active.name, "versions": [r.status() for r in self.versions]}

    # Commands.

    def parse(self, text: str) -> BlockspecConfig:
        """A new version's config: its `model` section and server.max_batch / prefill_chunk_tokens where given; the
        rest of server is the running server's."""
        raw = load_yaml(text, "config")
        if not isinstance(raw, dict) or "model" not in raw:
            raise InvalidArgument("config", "expected a mapping with a `model` section (the new version's pair)")
        server = raw.get("server") or {}
        if not isinstance(server, dict):
            raise InvalidArgument("server", "expected a mapping")
        other = sorted(set(server) - VERSION_SERVER_KEYS)
        if other:
            raise InvalidArgument(f"server.{other[0]}", "belongs to the running server, not to a version; a version "
                                  f"sets model and server.{' / server.'.join(sorted(VERSION_SERVER_KEYS))}")
        merged = self.active.cfg.model_dump(mode="json", exclude_unset=True)
        merged["server"] = {**merged.get("server", {}), **server}
        merged["model"] = raw["model"]
        return parse_config(merged, "config")

    async def start(self, text: str) -> dict:
        if self.starter is None:
            raise RolloutError("this server cannot start roles (--inprocess or --verifier-address): no rollout")
        cfg = self.parse(text)
        self.versions = [r for r in self.versions if r.state != "failed"]  # stopped already; kept for the status
        busy = self._with("starting", "checking", "ready")
        if busy is not None:
            raise RolloutError(f"version {busy.name} is {busy.state}: promote it or roll it back first")
        if any(r.name == cfg.version for r in self.versions):
            raise RolloutError(f"version {cfg.version} already runs here: give the new one its own model.version")
        self.startup(cfg)  # the config's own errors (a missing checkpoint, a bad method) now, naming the key
        previous = self._with("grace")
        if previous is not None:  # a rollback goes to the newest only: the older one finishes its streams now
            log.info("rollout: version %s leaves its grace period early: a new version starts", previous.name)
            self._retire(previous)
        served = ServedVersion(cfg, self.starter(cfg, f"{cfg.version}-"), self.loop_for(cfg), state="starting")
        self.versions.append(served)
        self._spawn(self._bring_up(served))
        log.info("rollout: version %s starts beside %s", served.name, self.active.name)
        return self.status()

    async def promote(self) -> dict:
        candidate = self._with("ready")
        if candidate is None:
            waiting = self._with("starting", "checking", "failed")
            why = f"version {waiting.name} is {waiting.state}" if waiting else "no version has passed its checks"
            raise RolloutError(f"nothing to promote: {why} (`blockspec rollout status`)")
        old = self._switch(candidate)
        self._close_check_server(candidate)
        old.state, old.grace_until = "grace", time.time() + self.admin.rollout_grace_s
        self._spawn(self._grace(old))
        log.info("rollout: version %s takes new requests; %s finishes its streams and stops in %.0f s unless rolled "
                 "back to", candidate.name, old.name, self.admin.rollout_grace_s)
        return self.status()

    async def rollback(self) -> dict:
        previous = self._with("grace")
        if previous is not None:
            bad = self._switch(previous)
            previous.grace_until = None
            self._retire(bad)
            log.info("rollout: rolled back: version %s takes new requests again; %s finishes its streams and stops",
                     previous.name, bad.name)
            return self.status()
        candidate = self._with("starting", "checking", "ready", "failed")
        if candidate is None:
            raise RolloutError(f"nothing to roll back to: {self.active.name} is the only version running")
        log.info("rollout: version %s is withdrawn before it served", candidate.name)
        self._retire(candidate)
        return self.status()

    def _switch(self, to: ServedVersion) -> ServedVersion:
        """New requests go to `to` from now on (one assignment on the event loop); the autoscaler follows it."""
        old, self.active = self.active, to
        self.router.service.version = to.version
        to.state, to.since = "live", time.time()
        self.switched_at = time.monotonic()
        return old

    # The work behind them.

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _bring_up(self, served: ServedVersion) -> None:
        try:
            live = len(self.active.version.schedulers) - len(self.active.version.draining)
            count = max(1, live)
            autoscaling = served.cfg.server.autoscaling
            if autoscaling is not None:
                count = min(max(count, autoscaling.min_replicas), autoscaling.max_replicas)
            pairs = await asyncio.gather(*(asyncio.to_thread(served.start_replica, i) for i in range(count)),
                                         return_exceptions=True)
            started = [p for p in pairs if not isinstance(p, BaseException)]
            served.pairs.extend(started)
            if served.state == "retiring":  # withdrawn while its roles loaded
                await self._stop_version(served)
                return
            failed = [p for p in pairs if isinstance(p, BaseException)]
            if failed:
                raise RuntimeError(f"a replica did not start: {failed[0]}")
            served.next_index = count
            loops = [await asyncio.to_thread(served.make_loop, pair) for pair in started]
            method = self.startup(served.cfg).method
            facts = await asyncio.to_thread(_facts, served.cfg, method, loops[0])
            served.version = await start_version(loops, facts, self.router.service.metrics, served.cfg.server.routing)
            served.roles = {id(s): pair for s, pair in zip(served.version.schedulers, started, strict=True)}
            self.router.service.versions[served.name] = served.version
            if served.state == "retiring":
                await self._stop_version(served)
                return
            served.state = "checking"
            await self._check(served)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever kept it from serving: said in status, the roles stopped
            if served.state == "retiring":  # withdrawn meanwhile: its stop is under way
                return
            log.error("rollout: version %s did not come up: %s", served.name, e)
            served.error = str(e)
            served.state = "failed"
            await self._stop_version(served, keep=True)

    async def _check(self, served: ServedVersion) -> None:
        """The go-live checks against the candidate, on a socket of this user's."""
        from blockspec.common.wire.grpc_server import start_server

        service = GenerationService(served.version)
        served.candidate_socket = os.path.join(tempfile.gettempdir(), f"blockspec-{os.getpid()}-{served.name}.sock")
        server, _, _ = await start_server(lambda s: register_generation(service, s), (SERVICE_NAME,), "127.0.0.1", 0,
                                          served.candidate_socket)
        served.check_server = server
        served.checks = await asyncio.to_thread(run_checks, served.cfg, f"unix:{served.candidate_socket}")
        if served.state == "retiring":  # withdrawn while its checks ran: it is stopping already
            return
        failed = [c for c in served.checks if c.status == "fail"]
        served.state = "failed" if failed else "ready"
        served.error = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        log.log(logging.ERROR if failed else logging.INFO, "rollout: version %s %s", served.name,
                f"failed its checks: {served.error}" if failed else "passed its checks: `blockspec rollout promote` "
                                                                     "sends it the new requests")

    def _close_check_server(self, served: ServedVersion) -> None:
        server = served.check_server
        if server is not None:
            served.check_server = None
            self._spawn(server.stop(1))
        if served.candidate_socket:
            try:
                os.unlink(served.candidate_socket)
            except FileNotFoundError:
                pass
            served.candidate_socket = None

    async def _grace(self, served: ServedVersion) -> None:
        await asyncio.sleep(max(0.0, served.grace_until - time.time()))
        if served.state == "grace":
            log.info("rollout: version %s's grace period is over: it finishes its streams and stops", served.name)
            self._retire(served)

    def _retire(self, served: ServedVersion) -> None:
        served.state, served.grace_until = "retiring", None
        self._spawn(self._stop_version(served))

    async def _stop_version(self, served: ServedVersion, keep: bool = False) -> None:
        """Drain every replica of `served` (its streams finish), stop its roles, and forget it (keep: a failed
        candidate stays in the status until the next rollout or a rollback)."""
        self._close_check_server(served)
        version = served.version
        if version is not None:
            await asyncio.gather(*(self.router.drain(s, version=version) for s in list(version.schedulers)))
            self.router.service.versions.pop(served.name, None)
            if version.metrics is not None:
                version.metrics.drop()
        for pair in list(served.pairs):
            served.pairs.remove(pair)
            for role in pair:
                if role is not None:
                    await asyncio.to_thread(role.stop)
        if not keep and served in self.versions:
            self.versions.remove(served)
            log.info("rollout: version %s stopped", served.name)

    def lost(self, served: ServedVersion, pair: tuple) -> None:
        """A verifier gone in a version that is not the active one: that replica takes no new request and its
        requests end UNAVAILABLE (the step that finds the verifier gone fails them); a version left with none stops
        (a rollback to it is no longer possible)."""
        served.pairs.remove(pair)
        version = served.version
        scheduler = next((s for s in version.schedulers if served.roles.get(id(s)) is pair), None) if version else None
        log.error("version %s (%s) lost a verifier%s", served.name, served.state,
                  "" if served.pairs else ": it stops")
        if scheduler is not None:
            version.draining.add(scheduler)
            self._spawn(self.router.drain(scheduler, version=version))
        for role in pair:
            if role is not None:
                self._spawn(asyncio.to_thread(role.stop))
        if not served.pairs and served.state != "retiring":
            served.error = served.error or "its replicas lost their verifiers"
            self._retire(served)

    async def close(self) -> None:
        """Cancel the rollout work in flight and close the check sockets; every version's replicas stop with the
        router (RouterServer.stop), their roles with serve."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for served in self.versions:
            self._close_check_server(served)


def _facts(cfg: BlockspecConfig, method: str, loop: StepLoop):
    from blockspec.services.serving.launch import role_facts

    return role_facts((loop.verifier, loop.drafter), method, cfg.model.spec_decode.num_speculative_tokens, cfg.version)


def run_checks(cfg: BlockspecConfig, where: str) -> list:
    """The go-live checks (golive.py) against the server at `where`, with server.admin's prompts and bounds."""
    from blockspec.common.prompts import read_prompts_file
    from blockspec.services.serving import golive
    from blockspec.services.training.default_pair import default_home

    admin = cfg.server.admin
    prompts_file = admin.check_prompts_file or str(default_home() / "base" / "heldout_prompts.jsonl")
    texts = read_prompts_file(prompts_file, "server.admin.check_prompts_file")[: admin.check_prompts]
    bounds = golive.Bounds(max_tokens=admin.check_max_tokens, rounds=1, min_ratio=admin.min_speedup, min_acceptance=0.0)
    return golive.run_checks(where, None, texts, bounds)["checks"]
