"""What `blockspec serve` starts, resolved from the config and checked before any role starts: the method, the drafter
and the roles' command lines."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.common.config import BlockspecConfig, ModelSection
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint, read_config
from blockspec.common.models.model_config import ModelConfig
from blockspec.common.runtime.device import DTYPES, MemorySplit
from blockspec.common.runtime.footprint import drafter_bytes, parameters
from blockspec.services.drafter.proposers import check_method, default_method

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Startup:
    """What to run, resolved from the config: the method, the drafter and the role command lines."""

    method: str
    drafter: str | None
    verifier_argv: tuple[str, ...]
    drafter_argv: tuple[str, ...] | None
    memory: MemorySplit | None = None  # each replica's part of a GPU (model.device cuda)


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
    _check_kv_cache(cfg)
    memory = None
    if m.device.startswith("cuda"):
        from blockspec.services.engine.engine import serving_len

        max_len = serving_len(read_model_config(m.target_model_path).max_position_embeddings, m.max_model_len)
        foot = drafter_footprint(method, drafter, DTYPES[m.dtype])
        memory = memory_split(m, foot, cfg.server.max_batch, max_len, replicas_per_gpu)
    common = ["--target", m.target_model_path, "--max-batch", str(cfg.server.max_batch), "--device", m.device,
              "--dtype", m.dtype, *(memory.argv() if memory else [])]
    if m.max_model_len:
        common += ["--max-model-len", str(m.max_model_len)]
    if method != "none" and "draft_model_dtype" in spec.model_fields_set and spec.draft_model_dtype != m.dtype:
        log.warning("spec_decode.draft_model_dtype %s: the drafter runs in model.dtype, %s (the dflash drafter reads "
                    "the target's embedding, LM head and tap features in place)", spec.draft_model_dtype, m.dtype)
    verifier = ["role", "verifier", *common, "--method", method] + (["--drafter", drafter] if drafter else [])
    verifier += ["--invariant"] if m.invariant else []
    verifier += ["--runner", m.runner] if m.runner != "auto" else []
    verifier += ["--tensor-parallel-size", str(m.tensor_parallel_size)] if m.tensor_parallel_size > 1 else []
    verifier += ["--kv-cache-tokens", str(m.kv_cache_tokens)] if m.kv_cache_tokens else []
    verifier += ["--kv-block-size", str(m.kv_block_size)] + ([] if m.prefix_caching else ["--no-prefix-caching"])
    drafter_argv = None
    if method != "none":
        drafter_argv = ["role", "drafter", *common, "--method", method]
        drafter_argv += ["--drafter", drafter] if drafter else []
        drafter_argv += [] if spec.use_dynamic_conv else ["--no-dynamic-conv"]
        drafter_argv += [] if spec.use_path_selector else ["--no-path-selector"]
    return Startup(method, drafter, tuple(verifier), tuple(drafter_argv) if drafter_argv else None, memory)


def read_model_config(path: str) -> ModelConfig:
    """A checkpoint directory's model config (no weights read)."""
    from blockspec.common.models.model_config import parse_config as parse_model_config

    return parse_model_config(read_config(Path(path)), Path(path))


@dataclass(frozen=True)
class DrafterFootprint:
    """A drafter's weights and KV cache shape, from its config alone (no weights read)."""

    weights: int  # bytes in the serving dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    captured: bool  # its proposals captured on a GPU (a dflash drafter): a spare slot

    def bytes(self, slots: int, max_len: int, dtype: torch.dtype) -> int:
        """What its role holds for `slots` requests of max_len (`footprint.drafter_bytes`, its start-up check's)."""
        return drafter_bytes(self.weights, self.num_layers, self.num_kv_heads, self.head_dim, slots, max_len, dtype,
                             self.captured)


def drafter_footprint(method: str, drafter: str | None, dtype: torch.dtype,
                      gpu: bool = True) -> DrafterFootprint | None:
    """The drafter role's footprint, on a GPU or (gpu False) the CPU; None where the method has no drafter model
    (ngram, none)."""
    if method == "dflash":
        from blockspec.services.drafter.dflash.config import DFlashConfig
        from blockspec.services.drafter.dflash.model import DFlashDrafter

        cfg = DFlashConfig.from_hf(read_config(Path(drafter)), drafter)
        with torch.device("meta"):
            weights = sum(t.numel() for t in DFlashDrafter(cfg).parameters()) * dtype.itemsize
        return DrafterFootprint(weights, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, gpu)
    if method == "draft_model":
        cfg = load_checkpoint(drafter, with_weights=False).config
        return DrafterFootprint(parameters(cfg).total * dtype.itemsize, cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, False)
    return None


def memory_split(m: ModelSection, drafter: DrafterFootprint | None, slots: int, max_len: int,
                 replicas_per_gpu: int = 1) -> MemorySplit:
    """Each replica's part of a GPU (`device.MemorySplit`): the drafter's share from what it holds for `slots`
    requests of max_len (server.max_batch, model.max_model_len), or model.drafter_memory_fraction; the verifier's the
    rest."""
    utilization = round(m.gpu_memory_utilization / replicas_per_gpu, 4)
    if drafter is None:
        return MemorySplit(utilization)
    if m.drafter_memory_fraction is not None:
        if m.drafter_memory_fraction >= utilization:
            raise InvalidArgument("model.drafter_memory_fraction", f"{m.drafter_memory_fraction} leaves the verifier "
                                                                   f"nothing of a replica's {utilization} of the GPU "
                                                                   "(model.gpu_memory_utilization over its replicas)")
        return MemorySplit(utilization, drafter_fixed=m.drafter_memory_fraction)
    return MemorySplit(utilization, drafter.bytes(slots, max_len, DTYPES[m.dtype]))


def _check_kv_cache(cfg: BlockspecConfig) -> None:
    """model.kv_cache_tokens holds one request of max_model_len (a shorter cache would cut every request's context)."""
    from blockspec.services.engine.engine import serving_len

    m = cfg.model
    if m.kv_cache_tokens is None:
        return
    max_len = serving_len(read_model_config(m.target_model_path).max_position_embeddings, m.max_model_len)
    if m.kv_cache_tokens < max_len:
        raise InvalidArgument("model.kv_cache_tokens", f"{m.kv_cache_tokens} is less than one request of "
                                                       f"max_model_len {max_len}")


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
