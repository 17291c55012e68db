"""Where the models run and in which precision (`--device` / `--dtype`, the config's `model.device` /
`model.dtype`), checked in one place with the flag or key named. Target, caches and drafter share one
device and dtype: the dflash drafter reads the target's tensors in place (docs/cli.md, "Device and dtype")."""

from __future__ import annotations

import logging

import torch

from blockspec.common.argtypes import check_device_name
from blockspec.common.errors import InvalidArgument

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


VERIFIER_SHARE = 0.8  # of model.gpu_memory_utilization when both roles share a GPU; the drafter gets the rest


def role_fractions(utilization: float, with_drafter: bool = True, replicas: int = 1) -> tuple[float, float]:
    """(verifier, drafter): the fractions of one GPU's memory each role may use (Ray asks for the same), when
    `replicas` replicas share the GPU. Without a drafter (plain decoding) the verifier has the whole of it."""
    share = utilization / replicas
    if not with_drafter:
        return round(share, 3), 0.0
    return round(share * VERIFIER_SHARE, 3), round(share * (1 - VERIFIER_SHARE), 3)


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


def claim_gpu_share(device: torch.device, fraction: float | None, need: int, role: str) -> None:
    """On a GPU, before the role allocates: refuse it when its static memory does not fit its share, then cap
    this process's allocator at that share, so a role that grows past it fails alone (torch's out-of-memory
    error) instead of starving the other role. Nothing on the CPU or without a share."""
    if device.type != "cuda" or fraction is None:
        return
    check_fits(role, need, torch.cuda.get_device_properties(device).total_memory, fraction)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
