"""Router-side clients of the two roles: each a long-lived bidirectional stream used synchronously from
the step-loop thread. A failing drafter degrades its requests to k=0 (plain decoding) and is
reconnected in the background of later steps; the output never changes."""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from blockspec.common.contracts import Draft, ProposeInput, StepCosts, VerifyInput, VerifyResult
from blockspec.common.models.block_pool import PrefixStats
from blockspec.common.sampling import GREEDY, SamplingParams, fill_pb
from blockspec.common.telemetry import tracing
from blockspec.common.wire import logprobs
from blockspec.common.wire.auth import ENV_ROLE_KEY, role_channel
from blockspec.protos import roles_grpc, roles_pb2

log = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class SharedQ:
    """A remote draft's q (rejection rule): the drafter wrote its rows into the verifier's shared q buffer at the
    request's slot, `width` tokens a row; the verify item carries only the width. Cutting the draft keeps it: the
    verifier reads as many rows as the draft has tokens."""

    width: int

    def head(self, _rows: int) -> SharedQ:
        return self


def _q_width(draft: Draft) -> int:
    if draft.q is None:
        return 0
    if not isinstance(draft.q, SharedQ):  # a q the verifier's process cannot see: verifying without it is not exact
        raise TypeError(f"a remote verify needs the draft's q in the shared buffer, got {type(draft.q).__name__}")
    return draft.q.width


class StreamCall:
    """One bidirectional stream: put a request, wait (with a timeout) for its response."""

    def __init__(self, steps_method) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = steps_method(iter(self._requests.get, _END))
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="role-stream")

    def call(self, message, timeout_s: float):
        self._requests.put(message)
        return self._reader.submit(next, self._responses).result(timeout_s)

    def close(self) -> None:
        self._requests.put(_END)
        self._responses.cancel()
        self._reader.shutdown(wait=False, cancel_futures=True)


class RemoteVerifier:
    """VerifierRole over gRPC. Its failures are fatal for the requests of the step (no fallback)."""

    def __init__(self, address: str, timeout_s: float = 60.0) -> None:
        self.channel = role_channel(address)
        stub = self._stub = roles_grpc.VerifierStub(self.channel)
        self.info = stub.Info(roles_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=True)
        self._stream = StreamCall(stub.Steps)
        self._timeout_s = timeout_s
        self._seq = 0
        self._pending: dict[str, roles_pb2.PrefillItem] = {}  # added, not yet sent
        self._prefilling: set[str] = set()  # sent, prompt not complete yet (chunked prefill)
        self._active: dict[str, int] = {}  # request -> tap buffer row
        self._release: list[str] = []
        self.memory = (0, 0)  # (rss, gpu) bytes of the role, from its last response
        self.num_blocks, self.block_size = self.info.num_blocks, self.info.block_size
        self._free_blocks = self.num_blocks  # from the last response
        # request -> (committed tokens, blocks held, blocks only it holds), from its last result
        self._blocks: dict[str, tuple[int, int, int]] = {}
        self.prefix_stats = PrefixStats()  # prompt tokens looked up and found cached, from the last response

    @property
    def num_slots(self) -> int:
        return self.info.num_slots

    @property
    def free_slots(self) -> int:
        return self.info.num_slots - len(self._active) - len(self._pending) - len(self._prefilling)

    @property
    def free_blocks(self) -> int:
        return self._free_blocks

    def blocks_needed(self, request_id: str, tokens: int) -> int:
        """As `Verifier.blocks_needed`, from the request's last result (its cache holds committed - 1 positions)."""
        committed, held, _ = self._blocks.get(request_id, (1, 0, 0))
        return max(0, -(-(committed - 1 + tokens) // self.block_size) - held)

    def measure_step_costs(self, max_width: int) -> StepCosts:
        pb = self._stub.Info(roles_pb2.InfoRequest(step_costs_max_width=max_width), timeout=self._timeout_s).step_costs
        widths = tuple(pb.widths)
        rows = [tuple(pb.seconds[i * len(widths) : (i + 1) * len(widths)]) for i in range(len(pb.batch_sizes))]
        return StepCosts(tuple(pb.batch_sizes), widths, tuple(rows))

    def slot_of(self, request_id: str) -> int:
        return self._active[request_id]

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams = GREEDY, salt: str = "",
            prompt_len: int | None = None) -> None:
        item = roles_pb2.PrefillItem(request_id=request_id, prompt_ids=prompt_ids, cache_salt=salt,
                                     prompt_len=prompt_len or 0)
        fill_pb(sampling, item.sampling)
        self._pending[request_id] = item

    def release(self, request_id: str) -> None:
        """The release travels with the next op; with none to come (this was the last request), in an op of its own
        now: a verifier must not hold a request after its stream has ended."""
        if self._pending.pop(request_id, None) is not None:
            return  # the verifier never heard of it
        *_, own = self._blocks.pop(request_id, (0, 0, 0))
        self._free_blocks += own  # free once the verifier has the release (before the next op's forward)
        if self._active.pop(request_id, None) is not None or request_id in self._prefilling:
            self._prefilling.discard(request_id)
            self._release.append(request_id)
        if self._release and not (self._active or self._prefilling or self._pending):
            try:
                self._call()
            except Exception as e:  # noqa: BLE001 - the verifier is gone: it holds nothing; the next op says so
                log.warning("releasing %d requests at the verifier failed (%s)", len(self._release), e)

    def _call(self, **ops) -> list[VerifyResult]:
        self._seq += 1
        req = roles_pb2.VerifierRequest(seq=self._seq, release=self._release, traceparent=tracing.traceparent(), **ops)
        self._release = []
        resp = self._stream.call(req, self._timeout_s)
        self.memory = (resp.rss_bytes, resp.gpu_bytes)
        self._free_blocks = resp.free_blocks
        self.prefix_stats.queries, self.prefix_stats.hits = resp.prefix_queries, resp.prefix_hits
        if resp.error:
            raise RuntimeError(f"verifier: {resp.error}")
        if resp.seq != req.seq:  # out of step with the stream: none of its results can be trusted
            raise RuntimeError(f"verifier answered op {resp.seq} to op {req.seq}")
        out = []
        for r in resp.results:
            self._active[r.request_id] = r.slot
            self._blocks[r.request_id] = (r.committed_len, r.blocks, r.own_blocks)
            out.append(VerifyResult(r.request_id, r.num_accepted, tuple(r.token_ids), r.eos, r.committed_len,
                                    logprobs.from_pb(r.logprobs)))
        return out

    def prefill(self, request_ids: Sequence[str], budget: int | None = None) -> list[VerifyResult]:
        new = [self._pending.pop(rid) for rid in request_ids if rid in self._pending]
        more = [rid for rid in request_ids if rid in self._prefilling]
        self._prefilling.update(item.request_id for item in new)
        results = self._call(prefill=new, prefill_continue=more, prefill_budget=budget or 0)
        self._prefilling.difference_update(r.request_id for r in results)
        return results

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyResult]:
        return self._call(verify=[roles_pb2.VerifyItem(request_id=i.request_id, draft_ids=i.draft.token_ids,
                                                       q_width=_q_width(i.draft)) for i in inputs])

    def close(self) -> None:
        self._stream.close()
        self.channel.close()


class RemoteDrafter:
    """DrafterRole over gRPC, sending only token deltas; on failure or timeout it drafts nothing."""

    def __init__(self, address: str | Callable[[], str], verifier: RemoteVerifier, timeout_s: float = 5.0,
                 retry_s: float = 1.0) -> None:
        # A callable address is asked again on every reconnect (a restarted Ray actor gets a new port).
        self._address, self.verifier = address, verifier
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.max_k = 0
        self.fallbacks = 0  # requests that stepped at k=0 because the drafter failed
        self.reconnects = 0
        self.memory = (0, 0)  # (rss, gpu) bytes of the role, from its last response
        self._sent: dict[str, int] = {}  # committed tokens the drafter has seen, per request
        self._release: list[str] = []
        self._seq = 0
        self._stream: StreamCall | None = None
        self._channel: grpc.Channel | None = None
        self._key = os.environ.get(ENV_ROLE_KEY, "")  # kept: every reconnect sends the key the server started with
        self._next_try = 0.0
        self._connect(wait=True)

    @property
    def up(self) -> bool:
        return self._stream is not None

    @property
    def address(self) -> str:
        return self._address() if callable(self._address) else self._address

    def _connect(self, wait: bool = False) -> None:
        self._channel = role_channel(self.address, self._key)
        stub = roles_grpc.DrafterStub(self._channel)
        info = stub.Attach(self.verifier.info, timeout=60 if wait else self.timeout_s, wait_for_ready=wait)
        self.max_k = info.max_k
        self._stream = StreamCall(stub.Steps)
        # Send whole contexts again (a restarted drafter knows nothing), and keep every request: one the drafter
        # may still hold (a timed-out op is applied all the same) gets its release.
        self._sent = dict.fromkeys(self._sent, 0)

    def _down(self, error: BaseException) -> None:
        log.warning("drafter failed (%s): continuing at k=0", error)
        if self._stream is not None:
            self._stream.close()
        if self._channel is not None:  # a failed reconnect's too
            self._channel.close()
        self._stream = self._channel = None
        self._next_try = time.monotonic() + self.retry_s

    def release(self, request_id: str) -> None:
        """As RemoteVerifier.release: with the next propose, or now when no request is left to propose for."""
        if self._sent.pop(request_id, None) is not None:
            self._release.append(request_id)
        if self._release and not self._sent and self._stream is not None:
            try:
                self._op([])
            except Exception as e:  # noqa: BLE001 - as a failed propose: reconnect later, the releases go then
                self._down(e)

    def _op(self, items: list) -> roles_pb2.DrafterResponse:
        """One op of the stream: the items and the releases pending (cleared once answered)."""
        self._seq += 1
        resp = self._stream.call(roles_pb2.DrafterRequest(seq=self._seq, items=items, release=self._release,
                                                          traceparent=tracing.traceparent()), self.timeout_s)
        self.memory = (resp.rss_bytes, resp.gpu_bytes)
        if resp.seq != self._seq:  # out of step with the stream: reconnect
            raise RuntimeError(f"drafter answered op {resp.seq} to op {self._seq}")
        self._release = []
        return resp

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        if self._stream is None and time.monotonic() >= self._next_try:
            try:
                self._connect()
                self.reconnects += 1
            except Exception as e:  # still down
                self._down(e)
        if self._stream is None:
            self.fallbacks += len(inputs)
            return [Draft(()) for _ in inputs]
        items = []
        for i in inputs:
            sent = self._sent.setdefault(i.request_id, 0)  # known from now on: the drafter may hold it after this op
            item = roles_pb2.ProposeItem(request_id=i.request_id, committed_len=len(i.token_ids),
                                         new_token_ids=i.token_ids[sent:], k=i.k,
                                         feature_slot=self.verifier.slot_of(i.request_id))
            if not sent:  # the drafter learns a request's sampling with its context, once
                fill_pb(i.sampling, item.sampling)
            items.append(item)
        try:
            resp = self._op(items)
        except Exception as e:
            self._down(e)
            self.fallbacks += len(inputs)
            return [Draft(()) for _ in inputs]
        drafts = []
        for i, item in zip(inputs, resp.items):
            if item.stale:
                self._sent[i.request_id] = 0  # resend the whole context next step
                drafts.append(Draft(()))
            else:
                self._sent[i.request_id] = len(i.token_ids)
                drafts.append(Draft(tuple(item.draft_ids), SharedQ(item.q_width) if item.q_width else None))
        return drafts

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._channel.close()
