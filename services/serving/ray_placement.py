"""`blockspec serve` on Ray: per replica one placement group of one bundle holding a verifier actor and a
drafter actor on the same node and GPU, each serving its role over gRPC; the router runs here.

The only module that imports Ray; the role classes stay plain.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import threading

from blockspec.common.config import BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.wire.auth import ensure_role_key
from blockspec.common.wire.tensor_share import cleanup_stale
from blockspec.services.serving.launch import remove_role_sockets, role_env, role_socket
from blockspec.services.serving.serve import RoleStartError, serve_roles
from blockspec.services.serving.startup import resolve_startup

log = logging.getLogger(__name__)

ALIVE_TIMEOUT_S = 5.0  # RayRole.alive: how long a verifier actor may take to answer before it counts as busy
ROLE_START_TIMEOUT_S = 300.0  # how long a role actor may load before the start is given up
PLACEMENT_TIMEOUT_S = 300.0  # how long the replicas' placement groups may wait for the cluster's resources
# The verifier actor's part of a replica's bundle in Ray's GPU count. Both actors sit in one bundle, so the split only
# tells Ray each actor uses the GPU; their memory shares are the roles' own (device.MemorySplit).
RAY_VERIFIER_PART = 0.8


class RoleActor:
    """Serves one role (`blockspec role ...` arguments) from inside a Ray actor process."""

    def __init__(self, argv: list[str]) -> None:
        from blockspec.common.telemetry import tracing
        from blockspec.services.serving import launch
        from blockspec.services.serving.role_args import parse_role_args

        args = parse_role_args(list(argv))
        if args.unix_socket and not os.path.isdir(os.path.dirname(args.unix_socket)):  # another node's temp directory
            args.unix_socket = None
        tracing.setup_tracing(f"blockspec-{args.role}")
        self.service = launch.role_service(args)
        serve = launch.serve_verifier if args.role == "verifier" else launch.serve_drafter
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="role-server", daemon=True).start()
        # Keep the server referenced: a collected grpc.aio server cancels all its calls.
        self.server, _, port = asyncio.run_coroutine_threadsafe(serve(self.service, "0.0.0.0", 0, args.unix_socket),
                                                                self.loop).result(300)
        self._address = f"{socket.gethostbyname(socket.gethostname())}:{port}"
        self._unix = f"unix:{args.unix_socket}" if args.unix_socket else None
        self._node = _node_id()

    def address(self, node: str | None = None) -> str:
        """Its address for a caller on Ray node `node`: the Unix socket where the caller shares this actor's node."""
        return self._unix if self._unix and node == self._node else self._address

    def pid(self) -> int:
        return os.getpid()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor, as CUDA_VISIBLE_DEVICES names them."""
        import ray

        return [str(g) for g in ray.get_gpu_ids()]


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class VerifierActor(RoleActor):
    """Named apart so that `ray list actors` and process titles tell the roles apart."""


class DrafterActor(RoleActor):
    pass


def ray_gpus(cfg: BlockspecConfig, with_drafter: bool, per_gpu: int) -> tuple[float, float, float]:
    """What a replica asks Ray for, in GPUs: (its bundle, the verifier actor, the drafter actor). A bundle is
    1 / per_gpu of a GPU, so Ray puts exactly per_gpu replicas on each GPU; both actors take their part of the
    one bundle (one fractional bundle sits on one GPU: the roles share it, as CUDA IPC needs). Ray counts these
    for placement only; the roles' memory caps are their --gpu-memory-fraction. Multiples of 1e-4, Ray's
    resolution, that add up to no more than one GPU. 0 on the CPU."""
    if not cfg.model.device.startswith("cuda"):
        return 0.0, 0.0, 0.0
    bundle = math.floor(1e4 / per_gpu) / 1e4
    if not with_drafter:
        return bundle, bundle, 0.0
    verifier = math.floor(bundle * RAY_VERIFIER_PART * 1e4) / 1e4
    return bundle, verifier, round(bundle - verifier, 4)


def replicas_per_gpu(cfg: BlockspecConfig, with_drafter: bool, cluster: dict) -> int:
    """How many replicas share each GPU: one a GPU while the cluster's GPUs last; past that they share them
    evenly, as --no-ray's replicas share model.device. Refuses, naming the key, what the cluster (Ray's
    `cluster_resources()`) can never hold, instead of waiting for resources that will not come."""
    replicas, roles = cfg.server.replicas, 2 if with_drafter else 1
    most = cfg.server.autoscaling.max_replicas if cfg.server.autoscaling else replicas  # each takes its GPU share
    if cluster.get("CPU", 0) < replicas * roles:
        raise InvalidArgument("server.replicas", f"{replicas} replica(s) of {roles} role(s) need {replicas * roles} "
                                                 f"CPUs on Ray (one a role); the cluster has {cluster.get('CPU', 0):g}")
    if not cfg.model.device.startswith("cuda"):
        return 1
    gpus = int(cluster.get("GPU", 0))
    if gpus < 1:
        raise InvalidArgument("model.device", f"{cfg.model.device!r}, but the Ray cluster has no GPU "
                                              f"({cluster.get('GPU', 0):g}); serve on 'cpu' or join a cluster with GPUs")
    ranks = cfg.model.tensor_parallel_size
    if ranks > 1:  # a replica takes `ranks` whole GPUs on one node
        if gpus < ranks:
            raise InvalidArgument("model.tensor_parallel_size", f"{ranks} ranks take a GPU each; the Ray cluster has "
                                                                f"{gpus}")
        return 1
    return -(-most // gpus)


def place_replicas(ray, cfg: BlockspecConfig, with_drafter: bool, per_gpu: int, timeout_s: float = PLACEMENT_TIMEOUT_S,
                   count: int | None = None):
    """One ready placement group per replica (`count`, default server.replicas): a single bundle (a CPU per role,
    its GPU share) holding both roles. Groups the cluster cannot place within `timeout_s` in all (their resources
    taken by other jobs; where the Ray autoscaler runs, it adds nodes for groups that wait) end the start with
    RoleStartError naming the replicas, what each asked for and what was free; the groups are removed then."""
    from ray.util.placement_group import placement_group, remove_placement_group

    gpu = ray_gpus(cfg, with_drafter, per_gpu)[0]
    ranks = cfg.model.tensor_parallel_size  # the verifier's other ranks are its child processes: a CPU each
    if ranks > 1 and gpu:  # and a whole GPU each, on one node (one bundle is placed on one node)
        gpu = ranks
    bundle = {"CPU": (2 if with_drafter else 1) + ranks - 1, **({"GPU": gpu} if gpu else {})}
    groups = [placement_group([bundle]) for _ in range(cfg.server.replicas if count is None else count)]
    ready = [pg.ready() for pg in groups]
    done, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)  # placed in parallel, one deadline
    if len(done) < len(groups):
        missing = [i for i, ref in enumerate(ready) if ref not in done]
        free = {k: round(v, 3) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        for group in groups:
            remove_placement_group(group)
        raise RoleStartError(f"server.replicas: Ray found no room for replica(s) {missing} (each {bundle}) within "
                             f"{timeout_s:g} s; free now: {free}")
    return groups


def start_replica(ray, cfg: BlockspecConfig, pg, verifier_argv, drafter_argv, per_gpu: int = 1,
                  index: int | str = 0):
    """The replica's verifier and drafter actors in its placement group `pg` (from `place_replicas`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _, v_gpu, d_gpu = ray_gpus(cfg, drafter_argv is not None, per_gpu)

    def actor(cls, argv, gpu: float, restarts: int, env: dict | None = None):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
        # A socket path named after this process: a restarted actor binds the same one (grpc removes the stale file).
        path = role_socket(f"{argv[1]}-{index}") if cfg.server.unix_sockets else None
        return ray.remote(cls).options(scheduling_strategy=strategy, num_cpus=1, num_gpus=gpu, max_restarts=restarts,
                                       max_task_retries=0, runtime_env={"env_vars": {**role_env(), **(env or {})}}
                                       ).remote([*argv, *(("--unix-socket", path) if path else ())])

    ranks = cfg.model.tensor_parallel_size
    if ranks > 1 and v_gpu:  # the verifier actor holds the ranks' GPUs (rank r on its r-th); the drafter joins rank 0's
        verifier = actor(VerifierActor, verifier_argv, ranks, 0)
        if drafter_argv is None:
            return verifier, None
        first = ray.get(verifier.gpu_ids.remote(), timeout=ROLE_START_TIMEOUT_S)[0]  # once the verifier has loaded
        drafter = actor(DrafterActor, drafter_argv, 0, -1, {"CUDA_VISIBLE_DEVICES": first,
                                                            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
        return verifier, drafter
    verifier = actor(VerifierActor, verifier_argv, v_gpu, 0)
    drafter = actor(DrafterActor, drafter_argv, d_gpu, -1) if drafter_argv else None  # Ray restarts a dead drafter
    return verifier, drafter


def _started(ray, actor, what: str) -> None:
    """Wait for a role actor to serve. One that died loading (a checkpoint it cannot read) or does not answer
    within ROLE_START_TIMEOUT_S ends the start with RoleStartError: one line, the role's own error last."""
    try:
        ray.get(actor.address.remote(), timeout=ROLE_START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RoleStartError(f"{what} did not answer within {ROLE_START_TIMEOUT_S:g} s") from None
    except ray.exceptions.RayError as e:  # the actor died: its own error is the message's last line
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        cause = re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1]) if lines else "no reason given"
        raise RoleStartError(f"{what} did not start: {cause}") from None


class RayRole:
    """A role actor as `serve_roles` sees it: a current address, and whether it lives. Ray restarts a drafter
    itself (it always counts as alive here); a verifier is not restarted: once Ray reports it dead, its replica is
    replaced where others serve meanwhile, else the server stops (exit code 1) instead of answering 503 for ever."""

    def __init__(self, ray, actor, restarted_by_ray: bool, group=None) -> None:
        """group: the replica's placement group (a verifier's), removed with this role."""
        self._ray, self._actor, self._restarted_by_ray, self._group = ray, actor, restarted_by_ray, group

    @property
    def address(self) -> str:
        return self._ray.get(self._actor.address.remote(_node_id()), timeout=2)

    def alive(self) -> bool:
        if self._restarted_by_ray:
            return True
        try:
            self._ray.get(self._actor.pid.remote(), timeout=ALIVE_TIMEOUT_S)
        except self._ray.exceptions.RayActorError:
            return False
        except self._ray.exceptions.GetTimeoutError:  # busy or slow is not dead; /health reports a role that hangs
            pass
        return True

    def stop(self) -> None:
        self._ray.kill(self._actor)
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._group)  # its other role goes with it


def _join(ray, address: str) -> None:
    """Join the Ray cluster at `address`. A HOST:PORT where nothing listens is refused at once (Ray itself retries
    for minutes); a cluster that refuses us (its auth token, its version) ends the start with one line."""
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and "://" not in address:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise InvalidArgument("--ray-address", f"{address}: no Ray cluster answers there ({e.strerror or e})") from None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:  # ValueError: an address Ray cannot read
        why = str(e).splitlines()[0]
        if e.__cause__ is not None and str(e.__cause__).strip():  # Ray's reason is the last line of its cause
            why += "; " + str(e.__cause__).strip().splitlines()[-1].strip()
        raise RoleStartError(f"--ray-address {address}: cannot join the Ray cluster: {why}") from None


def serve_ray(cfg: BlockspecConfig, host: str, port: int, grpc_port: int, ray_address: str | None) -> int:
    import ray

    p = resolve_startup(cfg)  # the config's own errors before Ray starts
    if cfg.model.device.startswith("cuda:"):  # Ray sets each actor's CUDA_VISIBLE_DEVICES: its GPU is "cuda"
        raise InvalidArgument("model.device", f"{cfg.model.device!r}: under Ray use 'cuda' (Ray assigns the GPU), "
                                              "or serve with --no-ray")
    cleanup_stale()
    remove_role_sockets()  # of servers that were killed
    ensure_role_key()  # the actors answer only this process (role_env passes it on)
    if ray_address:
        _join(ray, ray_address)
    else:  # a local cluster: logical CPUs enough for every role bundle, whatever the core count
        most = cfg.server.autoscaling.max_replicas if cfg.server.autoscaling else cfg.server.replicas
        most *= 2 if cfg.server.admin else 1  # a rollout runs two versions side by side
        per_replica = 2 + cfg.model.tensor_parallel_size - 1  # the roles, and a verifier's other ranks
        ray.init(num_cpus=max(os.cpu_count() or 1, per_replica * most), include_dashboard=False, log_to_driver=False)

    with_drafter = p.drafter_argv is not None

    def start_roles(q, per_gpu: int):
        groups = place_replicas(ray, cfg, with_drafter, per_gpu)
        roles = [start_replica(ray, cfg, pg, q.verifier_argv, q.drafter_argv, per_gpu, r) for r, pg in enumerate(groups)]
        out = []
        for r, (verifier, drafter) in enumerate(roles):  # the replicas load in parallel; wait for each
            for name, role in (("verifier", verifier), ("drafter", drafter)):
                if role is not None:
                    _started(ray, role, f"the {name} of replica {r}")
            out.append((RayRole(ray, verifier, restarted_by_ray=False, group=groups[r]),
                        RayRole(ray, drafter, restarted_by_ray=True) if drafter is not None else None))
        return out

    def start_one(c: BlockspecConfig, q, per_gpu: int, r: str) -> tuple:
        """One more replica of c's version (autoscaling, one replacing a lost one, a rollout): its own placement
        group, removed with it."""
        (group,) = place_replicas(ray, c, q.drafter_argv is not None, per_gpu, count=1)
        verifier, drafter = start_replica(ray, c, group, q.verifier_argv, q.drafter_argv, per_gpu, r)
        try:
            for name, role in (("verifier", verifier), ("drafter", drafter)):
                if role is not None:
                    _started(ray, role, f"the {name} of replica {r}")
        except BaseException:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(group)
            raise
        return (RayRole(ray, verifier, restarted_by_ray=False, group=group),
                RayRole(ray, drafter, restarted_by_ray=True) if drafter is not None else None)

    try:
        per_gpu = replicas_per_gpu(cfg, with_drafter, ray.cluster_resources())  # what never fits: refused before HTTP
        q = resolve_startup(cfg, replicas_per_gpu=per_gpu)  # the roles' memory shares, as Ray's GPU fractions

        def starter(c: BlockspecConfig, prefix: str):
            qc = q if c is cfg else resolve_startup(c, replicas_per_gpu=per_gpu)
            return lambda r: start_one(c, qc, per_gpu, f"{prefix}{r}")

        return serve_roles(cfg, q, host, port, grpc_port, lambda: start_roles(q, per_gpu), starter=starter)
    finally:
        ray.shutdown()
        cleanup_stale()  # the actors' segments and sockets: their processes are gone now
        remove_role_sockets(os.getpid())
