"""Zero-copy sharing across processes: the drafter maps the verifier's embedding and LM head, so its
private memory grows by its own weights only (measured with USS: pages this process alone holds)."""

from __future__ import annotations

import grpc
import pytest

from blockspec.protos import roles_grpc, roles_pb2
from blockspec.services.serving.serve import RoleProcess
from blockspec.services.training.tiny import build_tiny_checkpoint, build_tiny_drafter

pytestmark = pytest.mark.e2e
MiB = 1 << 20


def test_drafter_private_memory_does_not_grow_by_the_target_tensors(tmp_path, tokenizer):
    # vocab 65536 x hidden 256, untied: embedding and LM head are 64 MiB each in fp32.
    target = build_tiny_checkpoint(tmp_path / "big-vocab", "qwen3", hidden_size=256, tokenizer=tokenizer,
                                   vocab_size=65536)
    drafter = build_tiny_drafter(tmp_path / "drafter", target, selector_rank=4)
    argv = ("--target", str(target), "--method", "dflash", "--drafter", str(drafter), "--max-batch", "2")
    verifier = RoleProcess("verifier", ("role", "verifier", *argv))
    drafter_role = RoleProcess("drafter", ("role", "drafter", *argv))
    try:
        v_info = roles_grpc.VerifierStub(grpc.insecure_channel(verifier.address)).Info(roles_pb2.InfoRequest(), timeout=60)
        d_stub = roles_grpc.DrafterStub(grpc.insecure_channel(drafter_role.address))
        before = d_stub.Info(roles_pb2.InfoRequest(), timeout=60)
        d_stub.Attach(v_info, timeout=60)
        # Draft through the real role clients: the LM head is read whole, the embedding by row.
        from blockspec.common.contracts import ProposeInput
        from blockspec.services.router.roles import RemoteDrafter, RemoteVerifier

        remote_v = RemoteVerifier(verifier.address)
        # Not the serving deadline (5 s): the first proposal builds the drafter's packed weights, which on a
        # loaded machine may take longer, and a late one would draft nothing (the fallback), failing the test.
        remote_d = RemoteDrafter(drafter_role.address, remote_v, timeout_s=120.0)
        remote_v.add("r", list(range(5, 60)))
        committed = list(range(5, 60)) + list(remote_v.prefill(["r"])[0].token_ids)
        for _ in range(3):
            assert len(remote_d.propose([ProposeInput("r", committed, 7)])[0].token_ids) == 7
        after = d_stub.Info(roles_pb2.InfoRequest(), timeout=60)
        remote_d.close()
        remote_v.close()
        target_tensors = 2 * 65536 * 256 * 4
        growth = after.uss_bytes - before.uss_bytes
        print(f"drafter USS {before.uss_bytes / MiB:.1f} -> {after.uss_bytes / MiB:.1f} MiB after mapping "
              f"{target_tensors / MiB:.0f} MiB of target tensors (RSS {after.rss_bytes / MiB:.1f} MiB)")
        assert growth < target_tensors / 8, f"drafter private memory grew by {growth / MiB:.1f} MiB: a copy?"
    finally:
        drafter_role.stop()
        verifier.stop()
