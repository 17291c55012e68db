"""What `blockspec serve` starts, resolved from the config and checked before any role starts: the method, the drafter
and the roles' command lines."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from blockspec.common.config import BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import read_config
from blockspec.common.runtime.device import role_fractions
from blockspec.services.drafter.proposers import check_method, default_method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Startup:
    """What to run, resolved from the config: the method, the drafter and the role command lines."""

    method: str
    drafter: str | None
    verifier_argv: tuple[str, ...]
    drafter_argv: tuple[str, ...] | None


def _check_dir(key: str, path: str) -> None:
    try:
        read_config(path)
    except InvalidArgument as e:
        raise InvalidArgument(key, e.message + f" ({path})") from None


def resolve_startup(cfg: BlockspecConfig, replicas_per_gpu: int = 1, inprocess: bool = False) -> Startup:
    """The roles' command lines for this config; `replicas_per_gpu` replicas share model.device's memory (--no-ray
    puts every replica there, Ray gives each its own). inprocess: the checks only, for an engine in the server's
    process (a draft tree is verified there; role processes verify paths)."""
    m, spec = cfg.model, cfg.model.spec_decode
    if spec.draft_tree and not inprocess:
        raise InvalidArgument("model.spec_decode.draft_tree", f"{spec.draft_tree}: a draft tree is verified by an "
                                                              "engine in the server's process: serve --inprocess")
    _check_dir("model.target_model_path", m.target_model_path)
    _check_context(m.target_model_path, m.max_model_len)
    _check_tensor_parallel(m.target_model_path, m.tensor_parallel_size)
    _check_lookup_tokens(cfg)
    if spec.enabled and m.draft_model_path:
        _check_dir("model.draft_model_path", m.draft_model_path)
    if not spec.enabled:
        method, drafter = "none", None
        ignored = sorted(spec.model_fields_set - {"enabled"})
        if ignored:  # kept for when speculation is turned back on, but said: the server decodes plainly
            log.warning("spec_decode.enabled is false: plain decoding; spec_decode.%s ignored",
                        ", spec_decode.".join(ignored))
    else:
        drafter = m.draft_model_path
        method = spec.method or default_method(drafter)
        try:
            check_method(method, drafter)
        except InvalidArgument as e:
            raise InvalidArgument("model.draft_model_path", e.message) from None
        _check_drafter(cfg, method, drafter)
    common = ["--target", m.target_model_path, "--max-batch", str(cfg.server.max_batch), "--device", m.device,
              "--dtype", m.dtype]
    if m.max_model_len:
        common += ["--max-model-len", str(m.max_model_len)]
    if method != "none" and "draft_model_dtype" in spec.model_fields_set and spec.draft_model_dtype != m.dtype:
        log.warning("spec_decode.draft_model_dtype %s: the drafter runs in model.dtype, %s (the dflash drafter reads "
                    "the target's embedding, LM head and tap features in place)", spec.draft_model_dtype, m.dtype)
    verifier = ["role", "verifier", *common, "--method", method] + (["--drafter", drafter] if drafter else [])
    verifier += ["--invariant"] if m.invariant else []
    verifier += ["--runner", m.runner] if m.runner != "auto" else []
    verifier += ["--tensor-parallel-size", str(m.tensor_parallel_size)] if m.tensor_parallel_size > 1 else []
    shares = (role_fractions(m.gpu_memory_utilization, method != "none", replicas_per_gpu)
              if m.device.startswith("cuda") else None)
    verifier += ["--gpu-memory-fraction", str(shares[0])] if shares else []
    drafter_argv = None
    if method != "none":
        drafter_argv = ["role", "drafter", *common, "--method", method]
        drafter_argv += ["--gpu-memory-fraction", str(shares[1])] if shares else []
        drafter_argv += ["--drafter", drafter] if drafter else []
        drafter_argv += [] if spec.use_dynamic_conv else ["--no-dynamic-conv"]
        drafter_argv += [] if spec.use_path_selector else ["--no-path-selector"]
    return Startup(method, drafter, tuple(verifier), tuple(drafter_argv) if drafter_argv else None)


def _check_lookup_tokens(cfg: BlockspecConfig) -> None:
    """spec_decode.prompt_lookup_tokens only with prompt lookup on (else it would be ignored), and not where a verify
    has one width (model.invariant) or adaptive k's table stops at k + 1."""
    m, spec = cfg.model, cfg.model.spec_decode
    if spec.prompt_lookup_tokens and not spec.prompt_lookup:
        raise InvalidArgument("model.spec_decode.prompt_lookup_tokens", f"{spec.prompt_lookup_tokens} is not allowed "
                                                                        "without model.spec_decode.prompt_lookup: true")
    if spec.prompt_lookup_tokens and (m.invariant or spec.adaptive_k):
        other = "model.invariant" if m.invariant else "model.spec_decode.adaptive_k"
        raise InvalidArgument("model.spec_decode.prompt_lookup_tokens",
                              f"{spec.prompt_lookup_tokens} is not allowed with {other}: true (wider verifies than k + 1)")


def _check_tensor_parallel(target: str, world: int) -> None:
    """model.tensor_parallel_size: a target whose heads and MLP split `world` ways (common/runtime/tensor_parallel.py)."""
    from blockspec.common.models.model_config import parse_config as parse_model_config
    from blockspec.common.runtime.tensor_parallel import unsupported

    why = unsupported(parse_model_config(read_config(Path(target)), Path(target)), world)
    if why is not None:
        raise InvalidArgument("model.tensor_parallel_size", f"{world}: {why}")


def _check_context(target: str, max_model_len: int | None) -> None:
    """model.max_model_len within the target's context, before any role starts (a role would refuse it, seconds
    later, naming its own flag)."""
    from blockspec.common.models.model_config import parse_config as parse_model_config
    from blockspec.services.engine.engine import serving_len

    if max_model_len is None:
        return
    try:
        serving_len(parse_model_config(read_config(Path(target)), Path(target)).max_position_embeddings, max_model_len)
    except InvalidArgument as e:
        raise InvalidArgument("model.max_model_len", e.message) from None


def _check_drafter(cfg: BlockspecConfig, method: str, drafter: str | None) -> None:
    """What the roles would find only once started (tracebacks in their logs, seconds later): a dflash drafter
    built for another target, and k past what the drafter drafts."""
    from blockspec.common.models.model_config import parse_config as parse_model_config
    from blockspec.services.drafter.dflash.checkpoint import check_fits_target
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.proposers import MAX_K

    max_k = MAX_K
    if method == "dflash":
        target_dir = Path(cfg.model.target_model_path)
        try:
            dflash = DFlashConfig.from_hf(read_config(drafter), drafter)
            check_fits_target(dflash, parse_model_config(read_config(target_dir), target_dir), drafter)
        except InvalidArgument as e:
            raise InvalidArgument("model.draft_model_path", f"{e.field}: {e.message}") from None
        max_k = dflash.max_k
    k = cfg.model.spec_decode.num_speculative_tokens
    if not 1 <= k <= max_k:  # the one check of the configured k (the router and the roles take it as checked)
        raise InvalidArgument("model.spec_decode.num_speculative_tokens",
                              f"{k} is not allowed: the {method} drafter supports 1..{max_k}")
