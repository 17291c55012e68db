"""Where the models run and in which precision (`--device` / `--dtype`, the config's `model.device` /
`model.dtype`), checked in one place with the flag or key named. Target, caches and drafter share one
device and dtype: the dflash drafter reads the target's tensors in place (README, "Device and dtype")."""

from __future__ import annotations

import logging

import torch

from blockspec.common.errors import InvalidArgument

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device_name(name: str, field: str = "--device") -> str:
    """The device's syntax only ("cpu", "cuda", "cuda:N"): what a config can be checked for anywhere."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise InvalidArgument(field, f"{name!r} is not a device; use cpu, cuda or cuda:N")
    return name


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
                        help="the models' precision (default float32; bfloat16 on a GPU: see README, Exactness)")
