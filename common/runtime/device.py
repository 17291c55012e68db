"""Where the models run and in which precision (`--device` / `--dtype`, the config's `model.device` /
`model.dtype`), checked in one place with the flag or key named. Target, caches and drafter share one
device and dtype: the dflash drafter reads the target's tensors in place (docs/cli.md, "Device and dtype")."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from blockspec.common.argtypes import check_device_name
from blockspec.common.errors import InvalidArgument

if TYPE_CHECKING:
    from blockspec.common.runtime.footprint import VerifierLayout

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(device: str = "cpu", dtype: str = "float32", device_field: str = "--device",
            dtype_field: str = "--dtype") -> tuple[torch.device, torch.dtype]:
    """(torch device, torch dtype) for the names given, on this machine: a CUDA device must exist here."""
    check_device_name(device, device_field)
    if dtype not in DTYPES:
        raise InvalidArgument(dtype_field, f"{dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(device_field, f"{device!r}: CUDA is not available on this machine (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidArgument(device_field, f"{device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dtype != "float32":
        log.warning("%s on the CPU: torch's own ops instead of the fp32 C++ kernels (slower)", dtype)
    return dev, DTYPES[dtype]


def add_device_args(parser, default_device: str = "cpu") -> None:
    """`--device` and `--dtype` on a command (checked by `resolve` when the command runs)."""
    parser.add_argument("--device", default=default_device,
                        help=f"where the target and the drafter run: cpu, cuda or cuda:N (default {default_device})")
    parser.add_argument("--dtype", default="float32", choices=tuple(DTYPES),
                        help="the models' precision (default float32; bfloat16 on a GPU: see docs/exactness.md)")


DRAFTER_MARGIN = 0.05  # over what the drafter counts (weights, KV cache): its steps' intermediates, allocator rounding
DRAFTER_SLACK = 256 * 2**20  # bytes, likewise: a small drafter's intermediates are not 5% of it


def drafter_fraction(need: int, total: int) -> float:
    """The drafter role's fraction of a GPU of `total` bytes from what it holds (`footprint.drafter_bytes`), with a
    margin, rounded up to 1e-4."""
    return math.ceil((need * (1 + DRAFTER_MARGIN) + DRAFTER_SLACK) / total * 1e4) / 1e4


@dataclass(frozen=True)
class MemorySplit:
    """One replica's part of a GPU: `utilization` of its memory for both roles (model.gpu_memory_utilization over
    the replicas sharing the GPU); the drafter's part fixed (`drafter_fixed`, model.drafter_memory_fraction) or from
    what it holds (`drafter_need` bytes, none without a drafter); the verifier's the rest. Resolved on the GPU the
    roles run on (`fractions`), where its total memory is known."""

    utilization: float
    drafter_need: int = 0
    drafter_fixed: float | None = None

    def fractions(self, total: int) -> tuple[float, float]:
        """(verifier, drafter): the fractions of a GPU of `total` bytes each role may use."""
        drafter = self.drafter_fixed
        if drafter is None:
            drafter = drafter_fraction(self.drafter_need, total) if self.drafter_need else 0.0
        verifier = round(self.utilization - drafter, 4)
        if verifier <= 0:
            held = (f"model.drafter_memory_fraction {drafter}" if self.drafter_fixed is not None else
                    f"the drafter's {self.drafter_need / 2**30:.2f} GiB ({drafter:.4f} of {total / 2**30:.1f} GiB)")
            raise InvalidArgument("model.gpu_memory_utilization", f"{held} leaves the verifier nothing of a replica's "
                                                                  f"{self.utilization:.4f}; raise it, lower "
                                                                  "server.max_batch or model.max_model_len")
        return verifier, drafter

    def argv(self) -> list[str]:
        """The split on a role's command line (`from_args` reads it back)."""
        drafter = (["--drafter-memory-fraction", str(self.drafter_fixed)] if self.drafter_fixed is not None else
                   ["--drafter-memory", str(self.drafter_need)] if self.drafter_need else [])
        return ["--gpu-memory-utilization", str(self.utilization), *drafter]

    @staticmethod
    def from_args(args) -> MemorySplit | None:
        if args.gpu_memory_utilization is None:
            return None
        return MemorySplit(args.gpu_memory_utilization, args.drafter_memory or 0, args.drafter_memory_fraction)


def role_fraction(device: torch.device, split: MemorySplit | None, role: str) -> float | None:
    """A role's fraction of this GPU's memory under `split`; None on the CPU or without one."""
    if device.type != "cuda" or split is None:
        return None
    verifier, drafter = split.fractions(torch.cuda.get_device_properties(device).total_memory)
    return verifier if role == "verifier" else drafter


def tensor_bytes(tensors, dtype: torch.dtype) -> int:
    """Bytes of these tensors' elements in `dtype` (what weights take once moved to the device)."""
    return sum(t.numel() for t in tensors) * dtype.itemsize


def check_fits(role: str, need: int, total: int, fraction: float) -> None:
    """Refuse a role whose static memory (`need` bytes) exceeds its share of a GPU of `total` bytes."""
    share = int(total * fraction)
    if need > share:
        raise InvalidArgument("model.gpu_memory_utilization",
                              f"the {role} role needs {need / 2**30:.2f} GiB (weights, KV cache, buffers) but its share is "
                              f"{fraction:.3f} of the GPU's {total / 2**30:.1f} GiB = {share / 2**30:.2f} GiB; raise "
                              "gpu_memory_utilization or lower server.max_batch or model.max_model_len")


def kv_cache_blocks(layout: VerifierLayout, max_len: int, total: int | None = None, fraction: float | None = None,
                    kv_tokens: int | None = None) -> int | None:
    """The verifier's KV blocks: `kv_tokens`' (model.kv_cache_tokens), else on a GPU (`total` bytes, its `fraction`)
    what the share leaves beside the weights, states, buffers and `footprint.STEP_RESERVE`, else None (the runner's
    default: max_batch requests of max_len). On a GPU refused where the blocks exceed the share or do not hold one
    request of max_len."""
    blocks = layout.blocks_for(kv_tokens) if kv_tokens else None
    if total is None or fraction is None:
        return blocks
    from blockspec.common.runtime.footprint import STEP_RESERVE

    share = int(total * fraction)
    blocks = layout.blocks_in(share) if blocks is None else blocks
    one = layout.blocks_for(max_len)
    if layout.held(max(blocks, one)) + STEP_RESERVE > share:
        tokens = layout.blocks_in(share) * layout.block_size
        raise InvalidArgument("model.kv_cache_tokens" if kv_tokens and blocks >= one else "model.max_model_len",
                              f"the verifier's share, {fraction:.4f} of the GPU's {total / 2**30:.1f} GiB = "
                              f"{share / 2**30:.2f} GiB, holds {layout.fixed / 2**30:.2f} GiB of weights, states and "
                              f"buffers, {STEP_RESERVE / 2**30:.2f} GiB kept for a step's intermediates and KV "
                              f"blocks for {tokens} tokens; {max(blocks, one) * layout.block_size} "
                              f"were asked (max_model_len {max_len}"
                              + (f", kv_cache_tokens {kv_tokens})" if kv_tokens else ")")
                              + "; raise gpu_memory_utilization or lower server.max_batch or model.max_model_len")
    return blocks


def claim_gpu_share(device: torch.device, fraction: float | None, need: int, role: str) -> None:
    """On a GPU, before the role allocates: refuse it when its static memory does not fit its share, then cap
    this process's allocator at that share, so a role that grows past it fails alone (torch's out-of-memory
    error) instead of starving the other role. Nothing on the CPU or without a share."""
    if device.type != "cuda" or fraction is None:
        return
    check_fits(role, need, torch.cuda.get_device_properties(device).total_memory, fraction)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
