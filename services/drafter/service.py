"""The drafter role over gRPC: a proposer fed with token deltas, versioned by committed length, and
(dflash) mapping the verifier's shared embedding, LM head and tap buffer instead of copying them."""

from __future__ import annotations

import logging
import time

import grpc
import psutil
import torch

from blockspec.common.contracts import Q_ROWS, ProposeInput
from blockspec.common.kernels import cpu_kernels
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.models.kv_cache import slot_rows
from blockspec.common.runtime.device import claim_gpu_share, tensor_bytes
from blockspec.common.runtime.footprint import drafter_bytes
from blockspec.common.sampling import SamplingParams, from_pb
from blockspec.common.telemetry import tracing
from blockspec.common.wire.role_stream import RoleStream
from blockspec.common.wire.tensor_share import open_pb
from blockspec.protos import roles_grpc, roles_pb2
from blockspec.services.drafter.proposers import TargetView, build_proposer, check_method

log = logging.getLogger(__name__)


def _claim_share(method: str, drafter_path: str | None, dflash_model, num_slots: int, max_len: int,
                 device: torch.device, dtype: torch.dtype, fraction: float | None) -> None:
    """On a GPU with a memory share: the drafter's weights and its own KV cache must fit it, checked before
    they are moved there (common/device.claim_gpu_share)."""
    if device.type != "cuda" or fraction is None or method not in ("dflash", "draft_model"):
        return
    if dflash_model is not None:
        weights, cfg = list(dflash_model.parameters()), dflash_model.cfg
    else:
        from blockspec.common.models.decoder import Decoder

        cfg = load_checkpoint(drafter_path, with_weights=False).config
        with torch.device("meta"):  # shapes only
            weights = list(Decoder(cfg).parameters())
    # a dflash proposer on a GPU captures its proposals: a spare slot (proposers/dflash.static_blocks)
    need = drafter_bytes(tensor_bytes(weights, dtype), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_slots,
                         max_len, dtype, dflash_model is not None)
    claim_gpu_share(device, fraction, need, "drafter")


class DrafterService(RoleStream, roles_grpc.DrafterServicer):
    role, span_name = "drafter", tracing.SPAN_DRAFTER_OP

    def __init__(self, method: str, drafter_path: str | None, target_path: str, num_slots: int, max_len: int,
                 use_dynamic_conv: bool = True, use_path_selector: bool = True, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, gpu_fraction: float | None = None) -> None:
        super().__init__()
        check_method(method, drafter_path)
        self.method, self.drafter_path, self.num_slots, self.max_len = method, drafter_path, num_slots, max_len
        self.modules = {"use_dynamic_conv": use_dynamic_conv, "use_path_selector": use_path_selector}
        self.target = load_checkpoint(target_path, with_weights=False)  # config and tokenizer: for the fit checks
        self.dflash_model = None
        self.proposer = None
        if method == "dflash":
            from blockspec.services.drafter.dflash.checkpoint import check_fits_target, load_drafter

            self.dflash_model = load_drafter(drafter_path)
            check_fits_target(self.dflash_model.cfg, self.target.config, str(drafter_path))
        _claim_share(method, drafter_path, self.dflash_model, num_slots, max_len, torch.device(device), dtype, gpu_fraction)
        if self.dflash_model is not None:
            # The verifier's shared tensors arrive on the same device, in the same dtype (Attach).
            self.dflash_model = self.dflash_model.to(device, dtype)
            if torch.device(device).type == "cpu":
                cpu_kernels.enabled()  # load the CPU kernel now, not during the first request
        else:
            self.proposer = build_proposer(method, self.target, drafter_path, num_slots, max_len, device=device, dtype=dtype)
        self._tokens: dict[str, list[int]] = {}  # committed tokens seen per request
        self._sampling: dict[str, SamplingParams] = {}  # per request, from its first op
        self._slots: dict[str, int] = {}  # request -> row of the verifier's tap buffer
        self._tap_buffer, self._tap_rows = None, []
        self._q_ids = self._q_probs = None  # the verifier's shared draft-q buffers (rejection rule)
        self._segments: tuple[bytes, ...] | None = None  # the handles last attached to (Attach)

    def close(self) -> None:
        pass  # nothing held outside the process (the verifier's segments are the verifier's)

    def _info(self) -> roles_pb2.DrafterInfo:
        max_k = self.dflash_model.cfg.max_k if self.dflash_model is not None else self.proposer.max_k
        mem = psutil.Process().memory_full_info()  # uss: private memory, for the sharing test
        return roles_pb2.DrafterInfo(method=self.method, max_k=max_k, attached=self.proposer is not None,
                                     rss_bytes=mem.rss, uss_bytes=mem.uss)

    async def Info(self, request, context: grpc.aio.ServicerContext) -> roles_pb2.DrafterInfo:
        return self._info()

    async def Attach(self, info: roles_pb2.VerifierInfo, context: grpc.aio.ServicerContext) -> roles_pb2.DrafterInfo:
        """Map the verifier's shared tensors. Attached to another verifier than before (it restarted: new segments),
        the drafter drops everything it held for the old one and maps the new one's."""
        segments = tuple(h.SerializeToString() for h in (info.embedding, info.lm_head, info.tap_buffer, info.draft_q_ids,
                                                         info.block_table))
        if self._segments is not None and segments != self._segments:
            log.info("attached to another verifier: dropping %d requests and the old mappings", len(self._tokens))
            for rid in list(self._tokens):
                self._forget(rid)
            self._tap_buffer = self._q_ids = self._q_probs = None
            self._tap_rows = []
            if self.dflash_model is not None:
                self.proposer = None  # rebuilt over the new mappings below
        self._segments = segments
        if info.HasField("draft_q_ids") and self._q_ids is None:
            self._q_ids, self._q_probs = open_pb(info.draft_q_ids), open_pb(info.draft_q_probs)
        if self.proposer is None:
            self._tap_buffer = open_pb(info.tap_buffer)
            # `_features`: each slot's rows, made once (through the shared block tables of a paged cache)
            self._tap_rows = slot_rows(self._tap_buffer, open_pb(info.block_table))
            view = TargetView(open_pb(info.embedding), open_pb(info.lm_head), self._features, self._tap_buffer)
            self.proposer = build_proposer("dflash", self.target, self.drafter_path, self.num_slots,
                                           min(self.max_len, info.max_len), view, self.dflash_model, **self.modules)
        return self._info()

    def _features(self, request_id: str):
        """The request's rows of the verifier's tap buffer (its first committed_len - 1 are the request's)."""
        return self._tap_rows[self._slots[request_id]]

    def _refusal(self) -> str | None:
        return "dflash drafter not attached to a verifier" if self.proposer is None else None

    def _items(self, req: roles_pb2.DrafterRequest) -> int:
        return len(req.items)

    def _forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._sampling.pop(request_id, None)
        self._slots.pop(request_id, None)
        self._sessions.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.release(request_id)

    def _accept(self, item: roles_pb2.ProposeItem) -> bool:
        """Apply a delta versioned by committed length; False (stale) when it does not follow our view. A request's
        sampling comes with its first context (and with the whole context again, after a reconnect)."""
        if item.HasField("sampling"):
            self._sampling[item.request_id] = from_pb(item.sampling)
        elif item.request_id not in self._sampling:  # its first op was lost: the router resends everything
            self._forget(item.request_id)
            return False
        known = self._tokens.setdefault(item.request_id, [])
        if item.committed_len == len(known) and known:
            return True  # a retry of a propose already applied: idempotent
        if item.committed_len == len(known) + len(item.new_token_ids):
            known.extend(item.new_token_ids)
            self._slots[item.request_id] = item.feature_slot
            return True
        if item.committed_len == len(item.new_token_ids) and list(item.new_token_ids[: len(known)]) == known:
            known.extend(item.new_token_ids[len(known) :])  # the whole context again (a reconnected router): go on
            self._slots[item.request_id] = item.feature_slot
            return True
        if item.committed_len > len(known):  # a gap (e.g. we restarted): the router resends everything
            self._forget(item.request_id)
        return False

    def _draft_item(self, item: roles_pb2.ProposeItem, draft) -> roles_pb2.DraftItem:
        """Pack a draft; its q (rejection rule) goes to the verifier's shared buffer at the request's slot."""
        if draft.q is None:
            return roles_pb2.DraftItem(request_id=item.request_id, draft_ids=draft.token_ids)
        if self._q_ids is None:  # q cannot reach the verifier: a draft without its q would not be lossless
            return roles_pb2.DraftItem(request_id=item.request_id)
        n, width = min(len(draft.token_ids), Q_ROWS), draft.q.token_ids.shape[-1]
        self._q_ids[item.feature_slot, :n, :width] = draft.q.token_ids[:n]
        self._q_probs[item.feature_slot, :n, :width] = draft.q.probs[:n]
        return roles_pb2.DraftItem(request_id=item.request_id, draft_ids=draft.token_ids[:n], q_width=width)

    def _run(self, req: roles_pb2.DrafterRequest, session: object = None) -> roles_pb2.DrafterResponse:
        started = time.perf_counter_ns()
        for rid in req.release:
            self._forget(rid)
        for item in req.items:
            self._sessions[item.request_id] = session
        fresh = [item for item in req.items if self._accept(item)]
        inputs = [ProposeInput(i.request_id, self._tokens[i.request_id], i.k, self._sampling[i.request_id]) for i in fresh]
        drafts = dict(zip((i.request_id for i in fresh), self.proposer.propose(inputs))) if inputs else {}
        items = [self._draft_item(i, drafts[i.request_id]) if i.request_id in drafts
                 else roles_pb2.DraftItem(request_id=i.request_id, stale=True) for i in req.items]
        return roles_pb2.DrafterResponse(seq=req.seq, items=items, forward_ns=time.perf_counter_ns() - started)
