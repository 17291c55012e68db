"""The verifier role over gRPC: one long-lived stream of prefill / verify / release ops, and the
target's embedding, LM head and tap-feature buffer exported as shared-memory handles."""

from __future__ import annotations

import logging
import time

import grpc
import torch

from blockspec.common.contracts import Q_ROWS, Q_WIDTH, Draft, VerifyInput
from blockspec.common.runtime.distributions import DraftDist
from blockspec.common.sampling import from_pb
from blockspec.common.telemetry import tracing
from blockspec.common.wire import logprobs
from blockspec.common.wire.role_stream import RoleStream
from blockspec.common.wire.tensor_share import SharedTensors, handle_to_pb
from blockspec.protos import roles_grpc, roles_pb2
from blockspec.services.verifier.verifier import Verifier

log = logging.getLogger(__name__)


def share_target_tensors(verifier: Verifier, shares: SharedTensors, target_path: str) -> roles_pb2.VerifierInfo:
    """Move the embedding, LM head, tap buffer and the KV cache's block tables into shared memory (the verifier keeps
    using them)."""
    model = verifier.runner.model
    tied = model.lm_head.weight is model.embed_tokens.weight
    emb, emb_handle = shares.export(model.embed_tokens.weight.data)
    model.embed_tokens.weight.data = emb
    head_handle = emb_handle
    if not tied:
        head, head_handle = shares.export(model.lm_head.weight.data)
        model.lm_head.weight.data = head
    info = roles_pb2.VerifierInfo(
        embedding=handle_to_pb(emb_handle), lm_head=handle_to_pb(head_handle), max_len=verifier.max_len,
        num_slots=verifier.runner.cache.num_slots, vocab_size=verifier.runner.config.vocab_size,
        tap_layers=verifier.runner.tap_layers, target_path=target_path,
    )
    cache = verifier.runner.cache
    info.num_blocks, info.block_size = cache.num_blocks, cache.block_size
    if verifier.tap_buffer is not None:
        verifier.tap_buffer, taps_handle = shares.export(verifier.tap_buffer)
        info.tap_buffer.CopyFrom(handle_to_pb(taps_handle))
        cache.table, table_handle = shares.export(cache.table)  # the drafter reads taps through the slots' tables
        info.block_table.CopyFrom(handle_to_pb(table_handle))
        verifier.share_taps()
    return info


def share_draft_q(num_slots: int, shares: SharedTensors, info: roles_pb2.VerifierInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a remote drafter writes its draft distributions into: ids, probs [slots, Q_ROWS, Q_WIDTH]."""
    ids, ids_handle = shares.export(torch.zeros(num_slots, Q_ROWS, Q_WIDTH, dtype=torch.long))
    probs, probs_handle = shares.export(torch.zeros(num_slots, Q_ROWS, Q_WIDTH))
    info.draft_q_ids.CopyFrom(handle_to_pb(ids_handle))
    info.draft_q_probs.CopyFrom(handle_to_pb(probs_handle))
    return ids, probs


def result_to_pb(verifier: Verifier, r) -> roles_pb2.VerifyResult:
    blocks, own = verifier.held_blocks(r.request_id)
    return roles_pb2.VerifyResult(request_id=r.request_id, num_accepted=r.num_accepted, token_ids=r.token_ids, eos=r.eos,
                                  committed_len=r.committed_len, slot=verifier.slot_of(r.request_id), blocks=blocks,
                                  own_blocks=own, logprobs=logprobs.to_pb(r.logprobs))


class VerifierService(RoleStream, roles_grpc.VerifierServicer):
    role, span_name = "verifier", tracing.SPAN_VERIFIER_OP

    def __init__(self, verifier: Verifier, target_path: str) -> None:
        super().__init__()
        self.verifier = verifier
        self.shares = SharedTensors()
        self.info = share_target_tensors(verifier, self.shares, target_path)
        self.q_ids, self.q_probs = share_draft_q(verifier.runner.cache.num_slots, self.shares, self.info)

    def close(self) -> None:
        self.shares.close()

    async def Info(self, request: roles_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> roles_pb2.VerifierInfo:
        width = request.step_costs_max_width
        if width and tuple(self.info.step_costs.widths)[-1:] != (width,):
            # Measured on the server's thread, as every op is (`Steps`): never alongside a step; only the first ask pays.
            costs = self.verifier.measure_step_costs(width)
            self.info.step_costs.CopyFrom(roles_pb2.StepCosts(
                batch_sizes=costs.batch_sizes, widths=costs.widths, seconds=[t for row in costs.seconds for t in row]))
        return self.info

    def _forget(self, request_id: str) -> None:
        self.verifier.release(request_id)

    def _items(self, req: roles_pb2.VerifierRequest) -> int:
        return len(req.prefill) + len(req.prefill_continue) + len(req.verify)

    def _draft_q(self, item: roles_pb2.VerifyItem) -> DraftDist | None:
        """The q rows the drafter left in the shared buffer for this request's draft (views, no copy)."""
        if not item.q_width:
            return None
        slot, n = self.verifier.slot_of(item.request_id), len(item.draft_ids)
        return DraftDist(self.q_ids[slot, :n, : item.q_width], self.q_probs[slot, :n, : item.q_width])

    def _run(self, req: roles_pb2.VerifierRequest, session: object = None) -> roles_pb2.VerifierResponse:
        started = time.perf_counter_ns()
        v = self.verifier
        try:
            for rid in req.release:
                v.release(rid)
                self._sessions.pop(rid, None)
            results = []
            if req.prefill or req.prefill_continue:
                for item in req.prefill:
                    v.add(item.request_id, list(item.prompt_ids), from_pb(item.sampling), item.cache_salt,
                          item.prompt_len or None)
                    self._sessions[item.request_id] = session
                # Prompts under way first, as the step loop orders them: new short prompts must not starve a long one.
                ids = list(req.prefill_continue) + [item.request_id for item in req.prefill]
                results += v.prefill(ids, req.prefill_budget or None)
            if req.verify:
                results += v.verify([VerifyInput(i.request_id, Draft(tuple(i.draft_ids), self._draft_q(i)))
                                     for i in req.verify])
            pb = [result_to_pb(v, r) for r in results]
        except Exception as e:  # the router fails these requests; the role keeps serving
            log.exception("verifier op failed")
            return roles_pb2.VerifierResponse(seq=req.seq, error=f"{type(e).__name__}: {e}")
        return roles_pb2.VerifierResponse(seq=req.seq, results=pb, forward_ns=time.perf_counter_ns() - started,
                                          free_blocks=v.free_blocks, prefix_queries=v.prefix_stats.queries,
                                          prefix_hits=v.prefix_stats.hits)
