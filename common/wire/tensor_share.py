"""Tensors shared between processes without copies: a handle travels once, the receiver maps the memory.

CPU: a file in /dev/shm mapped by both sides (torch.from_file, shared=True). GPU: a CUDA IPC handle
(torch's own reduction of a CUDA tensor). Handles are small, picklable values; never the data.
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "blockspec"


@dataclass(frozen=True)
class TensorHandle:
    kind: str  # "shm" or "cuda_ipc"
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]
    name: str = ""  # shm: file name in SHM_DIR
    payload: bytes = b""  # cuda_ipc: pickled (rebuild function, args) from torch's reduction


def _segment_name(owner_pid: int) -> str:
    return f"{PREFIX}-{owner_pid}-{uuid.uuid4().hex[:12]}"


class SharedTensors:
    """Segments this process exports; removed on close (and, for dead owners, by `cleanup_stale`)."""

    def __init__(self) -> None:
        self._owned: list[Path] = []

    def export(self, tensor: torch.Tensor) -> tuple[torch.Tensor, TensorHandle]:
        """A copy of `tensor` in shared memory (use it instead of the original) and its handle."""
        if tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            payload = pickle.dumps(reduce_tensor(tensor))
            return tensor, TensorHandle("cuda_ipc", str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), payload=payload)
        name = _segment_name(os.getpid())
        path = SHM_DIR / name
        shared = torch.from_file(str(path), shared=True, size=tensor.numel(), dtype=tensor.dtype).view(tensor.shape)
        shared.copy_(tensor)
        self._owned.append(path)
        return shared, TensorHandle("shm", str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), name=name)

    def close(self) -> None:
        for path in self._owned:
            path.unlink(missing_ok=True)
        self._owned.clear()


def open_handle(handle: TensorHandle) -> torch.Tensor:
    """Map the memory a handle names; writes by either side are seen by both (no copy)."""
    dtype = getattr(torch, handle.dtype)
    if handle.kind == "cuda_ipc":
        rebuild, args = pickle.loads(handle.payload)
        return rebuild(*args)
    if handle.kind != "shm":
        raise ValueError(f"unknown tensor handle kind {handle.kind!r}")
    path = SHM_DIR / handle.name
    if not path.is_file():
        raise FileNotFoundError(f"shared segment {path} is gone (its owner exited?)")
    numel = 1
    for d in handle.shape:
        numel *= d
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(handle.shape)


def handle_to_pb(h: TensorHandle):
    """A handle as the roles' wire message (blockspec.v1 TensorHandle)."""
    from blockspec.protos import roles_pb2

    return roles_pb2.TensorHandle(kind=h.kind, dtype=h.dtype, shape=h.shape, name=h.name, payload=h.payload)


def open_pb(pb) -> torch.Tensor:
    """The tensor a wire handle (blockspec.v1 TensorHandle) names, mapped in this process."""
    return open_handle(TensorHandle(kind=pb.kind, dtype=pb.dtype, shape=tuple(pb.shape), name=pb.name,
                                    payload=pb.payload))


def cleanup_stale() -> list[str]:
    """Remove segments whose owner process no longer exists (left behind by a killed owner)."""
    removed = remove_orphans(SHM_DIR, f"{PREFIX}-*")
    if removed:
        log.info("removed %d stale shared segments", len(removed))
    return removed


def remove_orphans(directory: Path, pattern: str, owner: int | None = None) -> list[str]:
    """Delete the files in `directory` matching `pattern` whose name carries a process id as its second
    dash-separated field: those of `owner`, or with owner None those whose process no longer exists."""
    removed = []
    for path in directory.glob(pattern):
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid == owner or (owner is None and not _running(pid)):
            try:
                path.unlink(missing_ok=True)
            except PermissionError:  # another user's (a sticky /dev/shm or /tmp): theirs to remove, not a reason to fail
                log.warning("cannot remove %s (another user's); leaving it", path)
                continue
            removed.append(path.name)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True
