"""The verifier role: owns the target and its KV cache; the source of truth for committed tokens."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from blockspec.common.contracts import Draft, DraftTree, StepCosts, VerifyInput, VerifyResult
from blockspec.common.kernels import cpu_kernels
from blockspec.common.kernels.delta_rule import PREFILL_BLOCK
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.kv_cache import slot_rows
from blockspec.common.runtime.backends import make_runner
from blockspec.common.runtime.distributions import DraftDist, LogProbRows, process
from blockspec.common.runtime.footprint import VerifierLayout, verifier_layout
from blockspec.common.runtime.logprobs import token_logprobs
from blockspec.common.runtime.runner import Segment
from blockspec.common.runtime.threads import ThreadGovernor
from blockspec.common.runtime.timing import interleaved
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS, extend_hashes
from blockspec.services.verifier.acceptance import (
    Acceptance,
    greedy_accept,
    rejection_accept,
    strict_accept,
    tree_accept,
)

log = logging.getLogger(__name__)


def rolled_back_verify(verifier: Verifier, request_ids: Sequence[str], width: int) -> Callable[[], None]:
    """A verify of `width - 1` drafts for each prefilled request, rolled back first: every call starts
    from the same committed state."""

    def run() -> None:
        verifier.roll_back(request_ids)
        verifier.verify([VerifyInput(r, Draft((5,) * (width - 1))) for r in request_ids])

    return run


def tree_rows(tree: DraftTree) -> tuple[int, ...]:
    """The parents of [anchor, tree tokens] as a runner segment takes them (the anchor the root)."""
    return (-1, *(j + 1 for j in tree.parents))


@dataclass
class _State:
    slot: int
    token_ids: list[int]  # committed: prompt + generated; the last one (anchor) is not in the cache yet
    prompt_len: int  # the request's own prompt (a resumed request's prompt_ids are more: what it had committed)
    sampling: SamplingParams
    salt: str = ""  # its prefix cache's (the tenant's): only blocks of the same salt are shared
    prefill_len: int = 0  # the tokens its prefill runs through (prompt_ids)
    hashes: list[int] = field(default_factory=list)  # its full blocks' prefix hashes so far (`_hashes`)


class Verifier:
    """Prefill prompts, verify drafts in one batched target forward, keep committed tokens."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        num_slots: int,
        max_len: int | None = None,
        query_width: int | None = None,
        max_prefill_tokens: int = 512,
        tap_layers: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        threads: ThreadGovernor | None = None,
        backend: str = "auto",
        tensor_parallel_size: int = 1,
        kv_blocks: int | None = None,
        block_size: int = BLOCK_TOKENS,
        prefix_caching: bool = True,
    ) -> None:
        """kv_blocks, block_size: the paged KV cache's (unset: num_slots requests of max_len; the CUDA runner's has
        one block more, where its padding rows write). prefix_caching (not the CUDA runner's): a prompt starts from the
        cached blocks of an earlier one with the same leading tokens and salt (docs/architecture.md#kv-cache)."""
        self.threads = threads  # polled before each forward: the CPU threads follow the machine's other load
        self.runner = make_runner(checkpoint, num_slots, max_len, query_width, tap_layers, dtype, device, backend,
                                  tensor_parallel_size, kv_blocks, block_size, prefix_caching)
        cache = self.runner.cache
        self.prefix_caching = cache.pool.caching
        # Tap features of every position the target has run, in the paged cache's blocks [blocks, block_size,
        # n_taps * hidden] (a CUDA runner's has a spare block after them, where its padding rows go).
        self.tap_buffer = self.runner.make_tap_buffer()
        self.share_taps()
        self.tokenizer = checkpoint.tokenizer
        self.eos_ids = frozenset(checkpoint.config.eos_token_ids)
        # On the CPU a prefill forward of at most MAX_ROWS padded rows (prompts x the longest) runs as one C++ call
        # (`cpu_kernels.decoder_rows`): several forwards that each fit are faster than fewer, wider ones that do not,
        # and each token's K/V are then the same bits however the prompt was split (what a cached prefix relies on).
        self.prefill_rows = cpu_kernels.MAX_ROWS if self.runner.device.type == "cpu" else None
        self.max_prefill_tokens = min(max_prefill_tokens, self.prefill_rows or max_prefill_tokens)
        self.prefix_stats = cache.pool.stats
        # A hybrid's prompt is split into forwards on the chunked delta rule's block boundaries only, so that each of
        # its tokens runs the same arithmetic however it was split (`delta_rule.prefill_blocks`).
        self.prefill_align = PREFILL_BLOCK if checkpoint.config.hybrid and max_prefill_tokens >= PREFILL_BLOCK else 1
        # A hybrid's prefix is cached with its states, saved where a prefill passes a multiple of this many positions
        # (whole KV blocks and whole chunks of the delta rule: the states there do not depend on the split)
        self.snapshot_every = (math.lcm(cache.block_size, PREFILL_BLOCK)
                               if self.prefix_caching and checkpoint.config.hybrid else None)
        self._requests: dict[str, _State] = {}

    @staticmethod
    def layout(checkpoint: Checkpoint, num_slots: int, tap_layers: Sequence[int], dtype: torch.dtype,
               graphs: bool = False, tensor_parallel_size: int = 1, block_size: int = BLOCK_TOKENS,
               max_len: int = 0) -> VerifierLayout:
        """What a verifier of these dimensions holds once built, by part (`footprint.verifier_layout`: weights counted
        from the checkpoint's tensors), before it is: its KV blocks are sized and a GPU memory share checked with it.
        graphs (the CUDA runner): also its spare block and what its captured steps keep (`CudaRunner.graph_bytes`, with
        block tables of max_len positions)."""
        weights = sum(t.numel() for t in checkpoint.weights.values()) * dtype.itemsize
        vocab = sum(t.numel() for name, t in checkpoint.weights.items()
                    if name.endswith(("embed_tokens.weight", "lm_head.weight"))) * dtype.itemsize
        return verifier_layout(checkpoint.config, weights, num_slots, len(tap_layers), dtype, block_size, graphs,
                               tensor_parallel_size, vocab, max_len)

    @staticmethod
    def static_bytes(checkpoint: Checkpoint, num_slots: int, max_len: int, tap_layers: Sequence[int],
                     dtype: torch.dtype, graphs: bool = False, tensor_parallel_size: int = 1,
                     block_size: int = BLOCK_TOKENS, num_blocks: int | None = None) -> int:
        """What `layout` holds with `num_blocks` KV blocks (unset: num_slots requests of max_len)."""
        layout = Verifier.layout(checkpoint, num_slots, tap_layers, dtype, graphs, tensor_parallel_size, block_size,
                                 max_len)
        return layout.held(num_slots * layout.blocks_for(max_len) if num_blocks is None else num_blocks)

    @property
    def max_len(self) -> int:
        """The longest context a request may reach: the runner's, within what the paged cache's blocks hold."""
        return min(self.runner.max_len, self.num_blocks * self.block_size)

    @property
    def num_slots(self) -> int:
        return self.runner.cache.num_slots

    @property
    def free_slots(self) -> int:
        return self.runner.cache.free_slots

    @property
    def num_blocks(self) -> int:
        """KV cache blocks (the pool's: a CUDA runner's spare is not one)."""
        return self.runner.cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.runner.cache.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks a request can take now (free, or cached and evictable)."""
        return self.runner.cache.pool.free

    def share_taps(self) -> None:
        """Make `features`' per-slot rows again (after the tap buffer or the block tables moved, into shared memory)."""
        cache = self.runner.cache
        self._tap_rows = ([] if self.tap_buffer is None else
                          slot_rows(self.tap_buffer, cache.table))

    def slot_of(self, request_id: str) -> int:
        return self._requests[request_id].slot

    def committed(self, request_id: str) -> list[int]:
        return self._requests[request_id].token_ids

    def roll_back(self, request_ids: Sequence[str]) -> None:
        """Undo every step after the prefill: each request back to its prompt, its first token the anchor
        (for timing the same step again)."""
        for r in request_ids:
            state = self._requests[r]
            del state.token_ids[state.prompt_len + 1 :]
            del state.hashes[len(state.token_ids) // self.runner.cache.block_size :]  # of blocks still committed
            self.runner.cache.set_length(state.slot, state.prompt_len)

    def measure_step_costs(self, max_width: int, context: int = 64, repeats: int = 15) -> StepCosts:
        """Time verify steps of batch sizes 1, 2, 4, ... (up to the free slots) at widths 1..max_width, on
        scratch requests of `context` prompt tokens, added and released here. Run it before serving.

        Cells timed by `interleaved` (an untimed round first: first touches of the caches, packed
        weights), the median per cell. A wider or larger step never costs less: each row of the
        table is made non-decreasing in width, each column in batch size.
        """
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= self.free_slots] or [1]
        widths = range(1, max_width + 1)
        context = max(1, min(context, self.max_len - max_width - 2))
        vocab, device = self.runner.config.vocab_size, self.runner.device.type
        ids = [f"__step_costs_{i}" for i in range(sizes[-1])]
        try:
            for i, rid in enumerate(ids):
                self.add(rid, [(16 + 7 * i + j) % vocab for j in range(context)])
            self.prefill(ids)
            seconds = interleaved({(b, w): rolled_back_verify(self, ids[:b], w) for b in sizes for w in widths},
                                  repeats, device)
        finally:
            for rid in ids:
                self.release(rid)
        table = [[seconds[b, w] for w in widths] for b in sizes]  # [batch size][width]
        for i, row in enumerate(table):
            for j in range(len(row)):
                row[j] = max(row[j], row[j - 1] if j else 0.0, table[i - 1][j] if i else 0.0)
        return StepCosts(tuple(sizes), tuple(widths), tuple(tuple(row) for row in table))

    def features(self, request_id: str):
        """Tap features of the request's slot by position, `kv_cache.BlockRows` through the slot's table: its first committed_len - 1 rows are the committed tokens'
        before the anchor (the rest is not theirs). The slot's rows are made once: indexing per call, right after a
        target forward, costs a visible share of a proposal."""
        return self._tap_rows[self._requests[request_id].slot]

    def _poll_threads(self) -> None:
        if self.threads is not None:
            self.threads.poll()

    def _forward(self, segments: list[Segment]):
        return self.runner.forward(segments, self.tap_buffer)  # the tap features to where their K/V go

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams = GREEDY, salt: str = "",
            prompt_len: int | None = None) -> int:
        """A new request whose prefill runs through prompt_ids (a preempted one resumes with every token it had
        committed, prompt_len its own prompt's). Its leading full blocks come from the prefix cache where an earlier
        request of the same salt left them (at least the last token is prefilled: its logits give the next).
        Returns the prompt tokens found cached."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        cache = self.runner.cache
        state = _State(cache.allocate(), list(prompt_ids), len(prompt_ids) if prompt_len is None else prompt_len,
                       sampling, salt, len(prompt_ids))
        self._requests[request_id] = state
        cached = 0
        if self.prefix_caching:
            cached = cache.attach(state.slot, self._hashes(state, (len(prompt_ids) - 1) // cache.block_size))
            self.prefix_stats.queries += len(prompt_ids)
            self.prefix_stats.hits += cached
        return cached

    def release(self, request_id: str) -> None:
        """Free the request's slot; its full blocks of committed tokens stay cached for later prompts."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            cache = self.runner.cache
            self._publish(state, min(cache.lengths[state.slot], len(state.token_ids) - 1))
            cache.release(state.slot)

    def _publish(self, state: _State, positions: int) -> None:
        """Cache the full blocks among the first `positions` of the request's committed tokens (their K/V written)."""
        if self.prefix_caching:
            self.runner.cache.publish(state.slot, self._hashes(state, positions // self.runner.cache.block_size))

    def _hashes(self, state: _State, blocks: int) -> list[int]:
        """The prefix hashes of the request's first `blocks` full blocks of committed tokens (each block hashed once
        in the request's life: a long prompt's prefill asks at every saved state)."""
        return extend_hashes(state.hashes, state.token_ids, self.runner.cache.block_size, state.salt, blocks)[:blocks]

    def held_blocks(self, request_id: str) -> tuple[int, int]:
        """KV cache blocks the request holds, and of them those no other request holds (what its release frees)."""
        cache = self.runner.cache
        held = cache.held[self._requests[request_id].slot]
        return len(held), sum(cache.pool.holders(b) == 1 for b in held)

    def blocks_needed(self, request_id: str, tokens: int) -> int:
        """Blocks the request takes to grow by `tokens` positions."""
        cache, state = self.runner.cache, self._requests[request_id]
        return max(0, cache.blocks_for(cache.lengths[state.slot] + tokens) - len(cache.held[state.slot]))

    def prefill(self, request_ids: Sequence[str], budget: int | None = None) -> list[VerifyResult]:
        """Run prompts through the target, at most max_prefill_tokens per forward (on the CPU also at most
        prefill_rows padded rows, where more than one prompt goes). With a budget, stop after that many prompt
        tokens (chunked prefill: a later call continues where this one stopped). Returns the first generated token
        of every request whose prompt is now complete."""
        self._poll_threads()
        remaining = math.inf if budget is None else budget
        pending, results, spent = list(request_ids), [], 0
        while pending and remaining > 0:
            room, segments, ends, promised = min(self.max_prefill_tokens, remaining), [], [], 0
            for rid in pending:
                if room <= 0:
                    break
                state = self._requests[rid]
                done = self.runner.cache.lengths[state.slot]  # prompt tokens already in the cache
                n = min(state.prefill_len - done, room)
                if self.snapshot_every:  # a forward ends where the prompt's last states before its last token are saved
                    last = (state.prefill_len - 1) // self.snapshot_every * self.snapshot_every
                    n = last - done if done < last < done + n else n
                if n < state.prefill_len - done:  # the prompt goes on later: it stops on a block boundary
                    aligned = (done + n) // self.prefill_align * self.prefill_align - done
                    if aligned <= 0 and (segments or spent):
                        break  # a later forward or call takes it
                    n = aligned if aligned > 0 else n  # a call with less room than a block: unaligned, not stuck
                width = max([n, *(len(s.token_ids) for s in segments)])
                if segments and self.prefill_rows and (len(segments) + 1) * width > self.prefill_rows:
                    break  # the next forward takes it
                need = self.blocks_needed(rid, n)
                if need > self.free_blocks - promised:
                    break  # too few blocks: it goes on once some are free (the step loop preempts for them)
                promised += need
                segments.append(Segment(state.slot, state.token_ids[done : done + n], last_only=True))
                ends.append((rid, done + n))
                room -= n
                remaining -= n
                spent += n
            if not segments:
                break
            out = self._forward(segments)
            segments_of = {rid: i for i, (rid, _) in enumerate(ends)}
            for (rid, end), logits in zip(ends, out.logits):
                state = self._requests[rid]
                if self.snapshot_every and end % self.snapshot_every == 0 and end < state.prefill_len:
                    blocks = end // self.runner.cache.block_size
                    self.runner.cache.snapshots.save(state.slot, self._hashes(state, blocks)[blocks - 1])
                if end == state.prefill_len:
                    self._publish(state, end)
                    pending.remove(rid)
                    greedy = out.greedy[segments_of[rid]] if out.greedy else None
                    acc = self._decide(state, logits[-1:], (), None, greedy)
                    results.append(self._commit(rid, acc, logits[-1:], (0,)))
        return results

    def verify(self, inputs: Sequence[VerifyInput]) -> list[VerifyResult]:
        """Target forward over [anchor, d1..dk] of every request at once, then the acceptance rule."""
        self._poll_threads()
        states = [self._requests[i.request_id] for i in inputs]
        segments = [Segment(s.slot, (s.token_ids[-1], *i.draft.token_ids)) if i.draft.tree is None else
                    Segment(s.slot, (s.token_ids[-1], *i.draft.tree.token_ids), parents=tree_rows(i.draft.tree))
                    for s, i in zip(states, inputs)]
        out = self._forward(segments)
        results = []
        for i, (inp, state, logits) in enumerate(zip(inputs, states, out.logits)):
            if inp.draft.tree is not None:  # the accepted branch's K/V and taps move into place
                acc, path = self._decide_tree(state, logits, inp.draft.tree)
                rows = [0, *(j + 1 for j in path)]  # the accepted branch's rows: row i gives committed token i
                self.runner.keep_path(state.slot, len(state.token_ids) - 1, rows, self.tap_buffer)
            else:
                acc = self._decide(state, logits, inp.draft.token_ids, inp.draft.q, out.greedy[i] if out.greedy else None)
                # The cache keeps the anchor and the accepted drafts; the rest is rolled back.
                self.runner.cache.set_length(state.slot, len(state.token_ids) + acc.num_accepted)
                rows = range(len(acc.token_ids))
            results.append(self._commit(inp.request_id, acc, logits, rows))
        return results

    @staticmethod
    def _decide_tree(state: _State, logits: torch.Tensor, tree: DraftTree) -> tuple[Acceptance, list[int]]:
        """`tree_accept` over logits [1 + tree size, vocab] (row 0 the anchor's, row i + 1 tree token i's), each row
        processed with its own path as the history."""
        sp = state.sampling
        if sp.has_processors:
            paths: list[list[int]] = [[]]
            for token, parent in zip(tree.token_ids, tree.parents):
                paths.append([*paths[parent + 1], token])
            processed = torch.cat([process(logits[r : r + 1].cpu(), [*state.token_ids, *path], state.prompt_len, (), sp)
                                   for r, path in enumerate(paths)])
        else:
            processed = logits.cpu().float()
        position = len(state.token_ids)
        if sp.greedy:
            return tree_accept(tree, "greedy", None, cpu_kernels.argmax_rows(processed), 0, position)
        return tree_accept(tree, sp.rule, LogProbRows(processed, sp), None, sp.seed, position)

    @staticmethod
    def _decide(state: _State, logits: torch.Tensor, draft_ids: Sequence[int], q: DraftDist | None,
                greedy: tuple[int, list[int]] | None = None) -> Acceptance:
        """The request's rule over logits [k + 1, vocab]; row i samples the token at committed_len + i. greedy: what
        the forward decided on the device for plain greedy (accepted drafts, argmax per row), where it did."""
        sp = state.sampling
        if sp.plain_greedy:
            if greedy is not None:
                accepted, target_ids = greedy
                return Acceptance(accepted, tuple(target_ids[: accepted + 1]))
            return greedy_accept(draft_ids, cpu_kernels.argmax_rows(logits))
        # Processors, warpers and the acceptance rules run on the host (a GPU target's logits come over).
        processed = process(logits.cpu(), state.token_ids, state.prompt_len, draft_ids, sp)
        if sp.greedy:
            return greedy_accept(draft_ids, cpu_kernels.argmax_rows(processed))
        logp, position = LogProbRows(processed, sp), len(state.token_ids)  # rows as the rule reads them
        if sp.rule == "strict":
            return strict_accept(draft_ids, logp, sp.seed, position)
        return rejection_accept(draft_ids, logp, q, sp.seed, position)

    def _commit(self, request_id: str, acc: Acceptance, logits: torch.Tensor, rows: Sequence[int]) -> VerifyResult:
        """Append the accepted tokens (up to an end-of-sequence one); rows: the logits row each was decided from."""
        num_accepted, token_ids = acc.num_accepted, acc.token_ids
        eos_at = next((i for i, t in enumerate(token_ids) if t in self.eos_ids), None)
        if eos_at is not None:  # nothing after an end-of-sequence token is committed
            token_ids = token_ids[: eos_at + 1]
            num_accepted = min(num_accepted, eos_at)
        state = self._requests[request_id]
        state.token_ids.extend(token_ids)
        top = state.sampling.logprobs
        logprobs = () if top is None else token_logprobs(logits, rows, token_ids, top)
        return VerifyResult(request_id, num_accepted, token_ids, eos_at is not None, len(state.token_ids), logprobs)
