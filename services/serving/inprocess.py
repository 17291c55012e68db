"""`blockspec serve --inprocess`: the router and both roles in this one process, as the in-process engine wires them.

No role processes and no role round trips: each step calls the verifier and the proposer directly. What it gives up
is the split deployment's isolation: a drafter that cannot load fails the start, one that fails in a step fails that
step's requests (a role process is restarted while its requests go on at k=0), and one replica only."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from blockspec.common.config import BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.runtime.device import claim_gpu_share, role_fraction
from blockspec.common.runtime.device import resolve as resolve_device
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.services.engine.engine import Engine
from blockspec.services.router.app import start_router
from blockspec.services.router.limits import TenantLimits
from blockspec.services.serving.serve import serve_roles
from blockspec.services.serving.startup import Startup, resolve_startup

log = logging.getLogger(__name__)


def serve_inprocess(cfg: BlockspecConfig, host: str, port: int, grpc_port: int) -> int:
    """Serve the config's model with the engine in this process: HTTP first (503 while it loads), then the engine,
    then the router over its step loop; until SIGTERM/SIGINT."""
    if cfg.server.replicas != 1:
        raise InvalidArgument("server.replicas", f"{cfg.server.replicas}: with --inprocess the server runs one replica "
                                                 "(its engine in this process)")
    p = resolve_startup(cfg, inprocess=True)  # the same checks, before anything loads, as for the role processes
    device, dtype = resolve_device(cfg.model.device, cfg.model.dtype, "model.device", "model.dtype")
    loaded: dict = {}

    def load() -> list:
        # On a GPU the process may use model.gpu_memory_utilization of its memory (the allocator is capped there).
        claim_gpu_share(torch.device(device), cfg.model.gpu_memory_utilization, 0, "server")
        loaded["engine"] = build_engine(cfg, p, device, dtype)
        return []  # no role processes to supervise

    async def router_over(_replicas, keys, tls):
        engine, spec = loaded["engine"], cfg.model.spec_decode
        facts = replace(engine.facts(spec.num_speculative_tokens if p.method != "none" else 0), version=cfg.version)
        return await start_router([engine.loop], facts, host, grpc_port, RouterMetrics(), keys,
                                  TenantLimits(cfg.server.rate_limit), tls)

    return serve_roles(cfg, p, host, port, grpc_port, load, router_over)


def build_engine(cfg: BlockspecConfig, p: Startup, device: torch.device | str, dtype: torch.dtype) -> Engine:
    """The engine of a config: the keys the role command lines carry (`startup.resolve_startup`), and the router's."""
    m, spec = cfg.model, cfg.model.spec_decode
    log.info("loading %s (%s%s) in this process", m.target_model_path, p.method,
             f", drafter {p.drafter}" if p.drafter else "")
    # on a GPU the verifier's KV cache takes what the drafter's part of gpu_memory_utilization leaves
    fraction = role_fraction(torch.device(device), p.memory, "verifier")
    return Engine(m.target_model_path, p.drafter, p.method, max_batch=cfg.server.max_batch, max_len=m.max_model_len,
                  invariant=m.invariant, use_dynamic_conv=spec.use_dynamic_conv,
                  use_path_selector=spec.use_path_selector,
                  adaptive_k=spec.adaptive_k, prompt_lookup=spec.prompt_lookup,
                  prompt_lookup_tokens=spec.prompt_lookup_tokens, prefill_chunk=cfg.server.prefill_chunk_tokens,
                  device=device, dtype=dtype, backend=m.runner, tensor_parallel_size=m.tensor_parallel_size,
                  draft_tree=spec.draft_tree, kv_cache_tokens=m.kv_cache_tokens, kv_block_size=m.kv_block_size,
                  prefix_caching=m.prefix_caching, verifier_fraction=fraction)
