"""Method `dflash`: the DFlash-2 block drafter proposes all k draft tokens in one forward pass,
conditioned on the target's tap features of the committed tokens."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch

from blockspec.common.contracts import Q_WIDTH, Draft, DraftTree, ProposeInput
from blockspec.common.kernels import cpu_kernels
from blockspec.common.models.decoder import rope_table
from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.runtime.distributions import DraftDist, WalkSampler, gumbel_at, walk_rows
from blockspec.services.drafter.dflash import draft_vocab
from blockspec.services.drafter.dflash.cpu_block import ENV_BF16, ENV_INT8, CpuDrafter
from blockspec.services.drafter.dflash.model import DFlashDrafter, DrafterContext

log = logging.getLogger(__name__)

# request id -> tap features [>= committed_len - 1, n_taps * H]: rows past committed_len - 1 are not the request's
FeatureSource = Callable[[str], torch.Tensor]


def static_blocks(device: torch.device) -> bool:
    """Whether greedy proposals run as captured blocks (dflash/captured.py): on CUDA."""
    return device.type == "cuda"


class DFlashProposer:
    method = "dflash"
    fallbacks = 0  # as a DrafterRole: in the router's process a failure is the step's, never a k = 0 fallback

    def __init__(
        self,
        drafter: DFlashDrafter,
        embedding: torch.Tensor,  # the target's [vocab, H]: used, never copied
        lm_head: torch.Tensor,  # the target's [vocab, H]
        features: FeatureSource,
        num_slots: int,
        max_len: int,
        use_dynamic_conv: bool = True,
        use_path_selector: bool = True,
        tap_buffer: torch.Tensor | None = None,  # the buffer `features` gives rows of: the captured proposal reads it
    ) -> None:
        cfg = drafter.cfg
        self.model, self.cfg = drafter, cfg
        self.embedding, self.lm_head, self.features = embedding, lm_head, features
        self.max_k = cfg.block_size - 1
        self.max_len = max_len
        # A draft tree's children per node at each depth (`Engine(draft_tree=...)`): () drafts one path
        self.tree: tuple[int, ...] = ()
        self.use_dynamic_conv = use_dynamic_conv and cfg.conv_kernel_size is not None
        self.use_path_selector = use_path_selector and cfg.selector_rank is not None
        # Context K/V of each request: one entry per committed position with known tap features.
        self.device = embedding.device
        if self.device.type == "cpu":
            cpu_kernels.enabled()  # build or load the CPU kernel now, not during the first request
        static = static_blocks(self.device)
        self.cache = SlotKVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim, embedding.dtype,
                                 self.device, spare_slots=int(static))
        self._cos, self._sin = (t.to(self.device, embedding.dtype) for t in rope_table(cfg, max_len + cfg.block_size))
        self._slots: dict[str, int] = {}
        # A draft vocabulary (dflash/draft_vocab.py): the drafter scores only those rows of the LM head, a copy.
        self.vocab_ids = drafter.draft_vocab if draft_vocab.enabled() else None
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(self.device)
            self.lm_head = torch.nn.Parameter(lm_head.detach()[self.vocab_ids], requires_grad=False)
        bf16, int8 = (os.environ.get(env, "1") != "0" for env in (ENV_BF16, ENV_INT8))
        fast = (CpuDrafter(drafter, self.use_dynamic_conv, bf16, int8)
                if self.device.type == "cpu" and cfg.plain_attention and cfg.input_embedding_scale in (None, 1.0)
                else None)
        self._cpu = fast if fast is not None and fast.usable and self.cache.k.dtype == torch.float32 else None
        if self._cpu is not None:
            self._cpu.bind(self.cache, self._cos, self._sin, self.embedding, self.vocab_ids)
        self._blocks = None
        if static:
            from blockspec.services.drafter.dflash.captured import CapturedBlocks

            self._blocks = CapturedBlocks(self, num_slots, self.device.type == "cuda", tap_buffer)
            if self._blocks.graphs.capture:  # the whole block, and each shorter one a short-blocks drafter runs
                self._blocks.warm_up(list(range(2, cfg.block_size + 1)) if cfg.short_blocks else [cfg.block_size])

    @property
    def kernel(self) -> str:
        """Where a greedy proposal runs, for reports: captured blocks, the C++ path with its weights, or the torch
        module."""
        if self._blocks is not None:
            return "captured blocks" if self._blocks.graphs.capture else "static blocks"
        return f"C++ ({self._cpu.weights})" if self._cpu is not None else "the torch module"

    def release(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.cache.release(slot)

    def _pending(self, request_ids: Sequence[str], ctx_lens: Sequence[int]) -> tuple[list[int], list[tuple]]:
        """The slot of each request, and the context K/V each still lacks to reach its `ctx_len` positions:
        (slot, start, end, the request's tap features: rows start .. end - 1 are read). Committed tokens never
        change, so cached positions stay valid: a retry adds nothing."""
        slots, pending = [], []
        for request_id, ctx_len in zip(request_ids, ctx_lens):
            if request_id not in self._slots:
                self._slots[request_id] = self.cache.allocate()
            slot = self._slots[request_id]
            slots.append(slot)
            start = self.cache.lengths[slot]
            if ctx_len > start:
                pending.append((slot, start, ctx_len, self.features(request_id)))
        return slots, pending

    def _extend(self, pending: Sequence[tuple], cpu: CpuDrafter | None) -> None:
        """Compute the pending context K/V, all requests in one pass (the rows are independent:
        projection, norm and RoPE per position)."""
        if not pending:
            return
        pieces = [features[start:end] for _, start, end, features in pending]
        positions = torch.cat([torch.arange(start, end, device=self.device) for _, start, end, _ in pending])  # [N]
        if cpu is not None:
            rows = torch.cat([torch.full((end - start,), slot) for slot, start, end, _ in pending])  # [N]: slot of each
            cpu.context(torch.cat(pieces), self.cache, rows, positions, self._cos, self._sin)
        else:  # every layer's K/V of the pending rows, stored by (slot, position) in one write per tensor
            cos, sin = self._cos[positions][None, None], self._sin[positions][None, None]  # [1, 1, N, hd] each
            layer_kv = self.model.context_kv(self.model.context(torch.cat(pieces))[None], cos, sin)
            rows = torch.cat([torch.full((end - start,), slot) for slot, start, end, _ in pending]).to(self.device)
            for layer, (k, v) in enumerate(layer_kv):  # k, v [1, kv_heads, N, hd]
                self.cache.k[layer][rows, :, positions] = k[0].transpose(0, 1)
                self.cache.v[layer][rows, :, positions] = v[0].transpose(0, 1)
        self._advance(pending)

    def _advance(self, pending: Sequence[tuple]) -> None:
        for slot, _, end, _ in pending:
            self.cache.set_length(slot, end)

    def propose(self, inputs: Sequence[ProposeInput]) -> list[Draft]:
        live = [i for i in inputs if i.k > 0 and len(i.token_ids) - 1 + self.cfg.block_size <= self.max_len]
        if not live:
            return [Draft(()) for _ in inputs]
        ctx_lens = [len(i.token_ids) - 1 for i in live]  # the anchor sits at position ctx_len
        slot_ids, pending = self._pending([i.request_id for i in live], ctx_lens)
        # The block is the one the drafter was trained with, [anchor, MASK x (block_size - 1)], and each request
        # takes its first k drafts: the reference's drafts for the same weights and context. A drafter marked
        # short_blocks runs, greedy, only [anchor, MASK x k] for the largest k asked: other drafts, and
        # (k + 1) / block_size of the cost. Sampled proposals keep the whole block (a shorter one moves their q).
        slots_used = max(i.k for i in live)
        greedy = all(i.sampling.greedy for i in live)
        B = min(self.cfg.block_size, slots_used + 1) if greedy and self.cfg.short_blocks else self.cfg.block_size
        if self.tree:  # a draft tree: the block as below, then the tree's walk (`_tree_of`)
            cpu = self._cpu if self._cpu is not None and cpu_kernels.enabled() else None
            with torch.inference_mode():
                hidden, logits, anchors = self._block(live, ctx_lens, slot_ids, pending, B, slots_used, cpu)
                return self._propose_tree(inputs, live, hidden, logits)
        if greedy and self._blocks is not None and self._blocks.fits(len(live)):
            with torch.inference_mode():
                rows = self._blocks.propose([i.token_ids[-1] for i in live], slot_ids, ctx_lens, B, pending)
            return self._drafts(inputs, live, rows, None)
        cpu = self._cpu if self._cpu is not None and cpu_kernels.enabled() else None  # the kernels may be switched off since
        fused = cpu is not None and self.use_path_selector and (greedy or self.cfg.sampling_width <= Q_WIDTH)
        panels = cpu.lm_head_panels(self.lm_head) if fused else None
        if panels is not None:  # the whole proposal in one C++ call (no autograd state to enter: it runs after
            # every target forward, on cold caches, where each Python step around it costs several times its warm cost)
            anchors = [i.token_ids[-1] for i in live]
            if greedy:
                rows, dists = cpu.propose(pending, anchors, slot_ids, ctx_lens, panels, B), None
            else:  # the walk samples in the C++, as `WalkSampler` does
                rows, q_ids, q_probs = cpu.propose(pending, anchors, slot_ids, ctx_lens, panels, B,
                                                   self._walk_sampling(live))
                dists = self._dists(live, q_ids, q_probs)
            self._advance(pending)
            return self._drafts(inputs, live, rows, dists)
        with torch.inference_mode():
            return self._propose_apart(inputs, live, ctx_lens, slot_ids, pending, B, slots_used, greedy, cpu)

    def _propose_apart(self, inputs: Sequence[ProposeInput], live: Sequence[ProposeInput], ctx_lens: list[int],
                       slot_ids: list[int], pending: list[tuple], B: int, slots_used: int, greedy: bool,
                       cpu: CpuDrafter | None) -> list[Draft]:
        """The proposal in steps: the context, the block (C++ or torch), the LM head and the walk or sampling."""
        hidden, logits, anchors = self._block(live, ctx_lens, slot_ids, pending, B, slots_used, cpu)
        if greedy:
            if self.use_path_selector and cpu is not None:
                tokens = cpu.walk(hidden, logits, anchors, self.vocab_ids)  # [R, k]
            else:
                tokens = self.greedy_tokens(hidden, logits, anchors)
            return self._drafts(inputs, live, tokens.tolist(), None)  # one tolist for the batch
        if self.use_path_selector and cpu is not None and self.cfg.sampling_width <= Q_WIDTH:
            tokens, q_ids, q = cpu.walk(hidden, logits, anchors, self.vocab_ids, self._walk_sampling(live))
        else:  # the torch walk, sampling every row and slot without a transfer between the slots
            sampler = WalkSampler([i.sampling for i in live], [len(i.token_ids) for i in live])
            tokens = self.greedy_tokens(hidden, logits, anchors, sampler)
            q_ids, q = sampler.candidates.cpu(), sampler.q()
        return self._drafts(inputs, live, tokens.tolist(), self._dists(live, q_ids, q))

    def _block(self, live: Sequence[ProposeInput], ctx_lens: list[int], slot_ids: list[int], pending: list[tuple],
               B: int, slots_used: int, cpu: CpuDrafter | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The context K/V brought up to date, then the block: the draft slots' hidden [R, k, H], their logits
        [R, k, V] and the anchors [R]."""
        dev = self.device
        self._extend(pending, cpu)
        anchors = torch.tensor([i.token_ids[-1] for i in live], device=dev)  # [R]
        slots, lens = torch.tensor(slot_ids, device=dev), torch.tensor(ctx_lens, device=dev)  # [R] each
        block_ids = torch.full((len(live), B), self.cfg.mask_token_id, device=dev)  # [R, B]: [anchor, MASK...]
        block_ids[:, 0] = anchors
        if cpu is not None:
            hidden = cpu.block(self.model.block_embeds(self.embedding, block_ids), self.cache, slots, lens, self._cos,
                               self._sin)  # [R, B, H]
        else:
            key_len = self.cache.key_span(max(ctx_lens))
            layer_kv = [self.cache.read(layer, slots, key_len) for layer in range(self.cfg.num_layers)]
            visible = torch.arange(key_len, device=dev)[None, :] < lens[:, None]  # [R, key_len]
            positions = lens[:, None] + torch.arange(B, device=dev)  # [R, B]
            ctx = DrafterContext(layer_kv, visible, (self._cos[positions][:, None], self._sin[positions][:, None]),
                                 self.cfg, positions)
            hidden = self.model(self.model.block_embeds(self.embedding, block_ids), ctx, self.use_dynamic_conv)  # [R, B, H]
        hidden = hidden[:, 1 : 1 + slots_used]  # [R, k, H]
        return hidden, self.model.draft_logits(hidden, self.lm_head), anchors  # logits [R, k, V]

    def _propose_tree(self, inputs: Sequence[ProposeInput], live: Sequence[ProposeInput], hidden: torch.Tensor,
                      logits: torch.Tensor) -> list[Draft]:
        """A draft tree per live request (`_tree_of`) from the block's hidden [R, k, H] and logits [R, k, V]."""
        width = Q_WIDTH  # a greedy row's children come from the first selector_top_k (`_tree_of`)
        if self.use_path_selector:
            greedy = all(i.sampling.greedy for i in live)
            width = self.cfg.selector_top_k if greedy else self.cfg.sampling_width
        unary, candidates = logits.topk(min(width, logits.shape[-1]), dim=-1)
        if self.vocab_ids is not None:
            candidates = self.vocab_ids[candidates]
        temps, seeds, streams, keeps_q = walk_rows([i.sampling for i in live])
        hidden, unary, candidates = hidden.cpu(), unary.cpu(), candidates.cpu()
        drafts = {}
        for r, inp in enumerate(live):
            tree = self._tree_of(hidden[r], unary[r], candidates[r], inp, temps[r], seeds[r], streams[r], keeps_q[r])
            drafts[inp.request_id] = Draft(tree.first_path(), tree=tree)
        return [drafts.get(i.request_id, Draft(())) for i in inputs]

    def _tree_depth(self, inp: ProposeInput, slots: int) -> int:
        """The request's k, less where the tree's tokens would not fit the context after its committed ones."""
        depth, size, width = 0, 0, 1
        while depth < min(inp.k, slots):
            width *= self.tree[depth] if depth < len(self.tree) else 1
            if len(inp.token_ids) + size + width > self.max_len:
                break
            size, depth = size + width, depth + 1
        return depth

    def _tree_of(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor, inp: ProposeInput,
                 temperature: float, seed: int, stream: int, keeps_q: bool) -> DraftTree:
        """A node at depth d gets tree[d] children (1 past the setting's end) among slot d + 1's candidates, scored
        after the node's token by the path selector: the best ones (greedy), or drawn without replacement by the
        Gumbel top-n of the walk's own keys at that position (strict: z plus the target's noise; rejection: log q
        plus the drafter's, q kept for the node's row). One child per node is the walk's own pick."""
        selector = self.model.candidate_selector if self.use_path_selector else None
        if not temperature and selector is not None:
            unary, candidates = unary[:, : selector.top_k], candidates[:, : selector.top_k]
        m = min(Q_WIDTH, candidates.shape[-1])
        tokens: list[int] = []
        parents: list[int] = []
        q_rows: dict[int, tuple[int, torch.Tensor]] = {}  # node row (0: the anchor) -> (slot, q over its first m)
        frontier, last = [-1], [int(inp.token_ids[-1])]  # the deepest nodes' indices and tokens
        position = len(inp.token_ids)
        for t in range(self._tree_depth(inp, hidden.shape[0])):
            n = self.tree[t] if t < len(self.tree) else 1
            P = len(frontier)  # every frontier node's scores at once: [P, top_k]
            scores = (unary[t].expand(P, -1) if selector is None else
                      selector.scores(hidden[t].expand(P, -1), unary[t].expand(P, -1), candidates[t].expand(P, -1),
                                      torch.tensor(last)))
            if not temperature:
                picks = scores.argmax(-1, keepdim=True) if n == 1 else scores.topk(min(n, scores.shape[-1])).indices
            else:
                z = scores[:, :m].double() / temperature
                key = z if not keeps_q else z.log_softmax(-1)
                if keeps_q:
                    q_rows.update((index + 1, (t, row)) for index, row in zip(frontier, key.exp()))
                key = key + gumbel_at(seed, position + t, stream, candidates[t, :m])
                picks = key.argmax(-1, keepdim=True) if n == 1 else key.topk(min(n, m)).indices
            ids = candidates[t][picks].tolist()  # [P, n]
            grown, last = [], []
            for index, children in zip(frontier, ids):
                for token in children:
                    tokens.append(token)
                    parents.append(index)
                    grown.append(len(tokens) - 1)
                    last.append(token)
            frontier = grown
        q = None
        if keeps_q:
            q_ids = torch.zeros(len(tokens) + 1, m, dtype=torch.long)
            q_probs = torch.zeros(len(tokens) + 1, m, dtype=torch.float32)
            for row, (t, probs) in q_rows.items():
                q_ids[row], q_probs[row] = candidates[t, :m], probs.float()
            q = DraftDist(q_ids, q_probs)
        return DraftTree(tuple(tokens), tuple(parents), q)

    def greedy_tokens(self, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                      sampler: WalkSampler | None = None) -> torch.Tensor:
        """The draft tokens [R, S] from the draft slots' hidden [R, S, H] and logits [R, S, V]: the path selector's
        walk from the anchors, or each slot's choice among its own top tokens; the best score, or what `sampler`
        picks."""
        if self.use_path_selector:
            return self.model.candidate_selector.walk(hidden, logits, anchors, sampler, self.vocab_ids)
        unary, candidates = logits.topk(min(Q_WIDTH, logits.shape[-1]), dim=-1)  # [R, S, m]
        candidates = candidates if self.vocab_ids is None else self.vocab_ids[candidates]
        if sampler is not None:
            sampler.begin(candidates)
        return torch.stack([candidates[:, t].gather(1, (unary[:, t].argmax(-1) if sampler is None else
                            sampler(t, unary[:, t]))[:, None]).squeeze(1)
                            for t in range(logits.shape[1])], 1)

    @staticmethod
    def _drafts(inputs: Sequence[ProposeInput], live: Sequence[ProposeInput], rows: list[list[int]],
                dists: list[DraftDist | None] | None) -> list[Draft]:
        """One Draft per input: rows[r] (k tokens or more) for live request r (with dists[r], the q its rows
        were sampled from, where it sampled; dists None: none did), nothing for the others."""
        if dists is None and len(live) == len(inputs):  # every input drafted (live is inputs, in order)
            return [Draft(tuple(row[: i.k])) for i, row in zip(inputs, rows)]
        drafts = {}
        for r, (i, row) in enumerate(zip(live, rows)):
            dist = dists[r] if dists else None
            drafts[i.request_id] = Draft(tuple(row[: i.k]), dist.head(i.k) if dist is not None else None)
        return [drafts.get(i.request_id, Draft(())) for i in inputs]

    @staticmethod
    def _dists(live: Sequence[ProposeInput], q_ids: torch.Tensor, q_probs: torch.Tensor) -> list[DraftDist | None]:
        """The q of each request's walk ([R, S, m] candidates and probabilities): rejection rows only."""
        return [DraftDist(q_ids[r], q_probs[r]) if i.sampling.rule == "rejection" and not i.sampling.greedy else None
                for r, i in enumerate(live)]

    @staticmethod
    def _walk_sampling(live: Sequence[ProposeInput]) -> tuple[list, ...]:
        """Per request, how the C++ walk picks (CpuDrafter.propose): `distributions.walk_rows`' temperature, seed,
        stream and q flag, with the first draft's position."""
        temps, seeds, streams, keeps_q = walk_rows([i.sampling for i in live])
        return temps, seeds, streams, [len(i.token_ids) for i in live], keeps_q
