"""Shared tensors: another process maps the same memory (no copy); segments are removed on close and
after their owner dies."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from blockspec.common.wire.tensor_share import SHM_DIR, SharedTensors, cleanup_stale, open_handle


def _child_reads_and_writes(handle, queue):
    t = open_handle(handle)
    queue.put(float(t.sum()))
    t[0, 0] = 42.0


def sum_in_child(handle) -> float:
    """Map `handle` in a fresh (spawned) process, return its sum; the child also writes 42 at [0, 0]."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_reads_and_writes, args=(handle, queue))
    proc.start()
    proc.join(120)
    return queue.get(timeout=5)


def test_another_process_sees_and_writes_the_same_memory():
    shares = SharedTensors()
    try:
        shared, handle = shares.export(torch.arange(12, dtype=torch.float32).view(3, 4))
        assert sum_in_child(handle) == 66.0
        assert float(shared[0, 0]) == 42.0  # the child's write, seen here: one memory, not a copy
    finally:
        shares.close()
    assert not (SHM_DIR / handle.name).exists()
    with pytest.raises(FileNotFoundError, match="is gone"):
        open_handle(handle)


def _child_exports_and_dies(queue):
    shares = SharedTensors()
    _, handle = shares.export(torch.zeros(4))
    queue.put(handle.name)  # exits without close(): a killed owner


def test_segments_of_dead_owners_are_cleaned_up():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_exports_and_dies, args=(queue,))
    proc.start()
    name = queue.get(timeout=60)
    proc.join(60)
    assert (SHM_DIR / name).exists()
    assert name in cleanup_stale()
    assert not (SHM_DIR / name).exists()


def test_another_users_orphan_is_left_without_failing(tmp_path, monkeypatch):
    """/dev/shm and /tmp are sticky: another user's file of a dead process cannot be removed. That is no reason for
    a server's start-up to fail (a root-run server once killed would crash-loop every later unit)."""
    from pathlib import Path

    from blockspec.common.wire.tensor_share import remove_orphans

    theirs, ours = tmp_path / "blockspec-999999-aa", tmp_path / "blockspec-999998-bb"
    theirs.touch()
    ours.touch()
    unlink = Path.unlink

    def sticky_unlink(path, missing_ok=False):
        if path == theirs:
            raise PermissionError(1, "Operation not permitted", str(path))
        unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", sticky_unlink)
    assert remove_orphans(tmp_path, "blockspec-*") == [ours.name]
    assert theirs.exists() and not ours.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")
def test_cuda_ipc_handle_maps_the_same_device_memory_in_another_process():
    shares = SharedTensors()
    t = torch.arange(12, device="cuda", dtype=torch.float32).view(3, 4)
    _, handle = shares.export(t)
    assert handle.kind == "cuda_ipc"
    assert sum_in_child(handle) == 66.0
    torch.cuda.synchronize()
    assert float(t[0, 0]) == 42.0
