"""One batched forward over a slot KV cache: each request brings its own number of new tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from blockspec.common.errors import ModelLoadError
from blockspec.common.kernels import cpu_kernels
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.decoder import AttentionBatch, Decoder, rope_table
from blockspec.common.models.hybrid import HybridDecoder
from blockspec.common.models.kv_cache import PagedKVCache
from blockspec.common.models.state_cache import HybridPagedKVCache, HybridStates
from blockspec.common.runtime.tensor_parallel import shard

log = logging.getLogger(__name__)

ROW_TILE = 8


@dataclass(frozen=True)
class Segment:
    """New tokens of one request, written at positions [length(slot), length(slot) + n)."""

    slot: int
    token_ids: Sequence[int]
    last_only: bool = False  # return only the last position's logits (prefill)
    # A token tree (a draft tree's verify): parents[i] is the index of token i's parent in token_ids, -1 for the first
    # (the anchor, which follows the committed tokens). Token i is at position length + depth(i) for RoPE and sees the
    # committed keys and its ancestors' (itself included); its K/V and taps are stored at length + i, and
    # `Runner.keep_path` moves an accepted branch into place. None: a sequence, each token after the one before.
    parents: tuple[int, ...] | None = None

    def depths(self) -> list[int]:
        """Each token's depth in the tree (the anchor's 0); ValueError where parents do not form one."""
        parents, n = self.parents, len(self.token_ids)
        if len(parents) != n or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, n)):
            raise ValueError(f"slot {self.slot}: parents {list(parents)} do not form a tree over {n} tokens "
                             "(the first -1, each other an earlier token's index)")
        depths = [0] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        return depths

    def visible(self) -> torch.Tensor:
        """[n, n] bool: token i sees token j (j is i or one of its ancestors)."""
        n = len(self.token_ids)
        seen = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                seen[i] = seen[self.parents[i]]
            seen[i, i] = True
        return seen


@dataclass(frozen=True)
class ForwardResult:
    logits: list[torch.Tensor]  # per segment: [n, vocab] fp32, or [1, vocab] when last_only
    # The outputs of the tap layers, one tensor [N, n_taps * hidden] (segments in order, padding left out; None
    # where the forward put them in a tap_dest), and `store(dest, rows)`, which puts such rows into dest
    # [slots, positions, ...] where the forward stored their K/V (AttentionBatch.store).
    tap_rows: torch.Tensor | None = None
    store: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    lengths: tuple[int, ...] = ()  # each segment's token count
    # Per segment, where the backend decided on the device (`cuda_runner`): the drafts a greedy verify of the segment
    # ([anchor, d1..]) accepts and the target's argmax of each returned row.
    greedy: list[tuple[int, list[int]]] | None = None

    @property
    def taps(self) -> list[torch.Tensor]:
        """Per segment: [n, n_taps * hidden]; [] without tap layers. Split on request: the step loop stores
        tap_rows whole (splitting them costs a little on every step)."""
        return list(self.tap_rows.split(list(self.lengths))) if self.tap_rows is not None else []


def decoder_class(cfg) -> type[Decoder | HybridDecoder]:
    """The decoder module a config needs: the hybrid one for Qwen3.5-style layer types."""
    return HybridDecoder if cfg.hybrid else Decoder


def build_decoder(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> Decoder | HybridDecoder:
    """A Decoder (a HybridDecoder for a hybrid model) holding the checkpoint's weights (HF names, `model.` prefix
    stripped). Built on the meta device and handed the checkpoint's tensors: no second copy (a 27B target would not
    fit twice)."""
    with torch.device("meta"):
        model = decoder_class(checkpoint.config)(checkpoint.config)
    weights = {k.removeprefix("model."): v for k, v in checkpoint.weights.items()}
    if checkpoint.config.tie_word_embeddings:
        weights.setdefault("lm_head.weight", weights.get("embed_tokens.weight"))
    expected = set(model.state_dict())
    missing = sorted(expected - set(weights))
    unexpected = sorted(k for k in set(weights) - expected if "rotary_emb" not in k)
    if missing or unexpected:
        raise ModelLoadError(
            str(checkpoint.path),
            f"weights do not fit a {checkpoint.config.family} model: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    for name, param in model.state_dict().items():
        if tuple(weights[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                str(checkpoint.path),
                f"tensor {name} has shape {tuple(weights[name].shape)}, config implies {tuple(param.shape)}",
            )
    model.load_state_dict({k: weights[k] for k in expected}, strict=True, assign=True)
    model = model.to(dtype)
    if checkpoint.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # one tensor, as the checkpoint has it
    return model.eval().requires_grad_(False)


def target_decoder(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, tap_layers: tuple[int, ...],
                   tp: tuple[int, int] = (0, 1)) -> Decoder:
    """A runner's decoder on its device: rank tp[0]'s shard where the target is split over tp[1] ranks. Tap layers
    outside 0..num_layers (the layers, and the final norm's output) are refused."""
    cfg = checkpoint.config
    bad = [layer for layer in tap_layers if not 0 <= layer <= cfg.num_layers]
    if bad:
        raise ValueError(f"tap layers {bad} outside 0..{cfg.num_layers}: the target's layers and {cfg.num_layers}, "
                         "its final norm's output")
    model = build_decoder(checkpoint, dtype)
    if tp[1] > 1:
        model = shard(model, *tp)
    return model.to(device)


def segment_starts(cache, max_len: int, segments: Sequence[Segment]) -> list[int]:
    """Each segment's first position (its slot's length), its slot's room for its tokens reserved (a paged cache's
    blocks); ValueError where its tokens do not fit max_len, `OutOfBlocks` where the blocks run out."""
    starts = [cache.lengths[s.slot] for s in segments]
    for seg, start in zip(segments, starts):
        n = len(seg.token_ids)
        if n < 1 or start + n > max_len:
            raise ValueError(f"slot {seg.slot}: {n} tokens at position {start} do not fit max_len {max_len}")
        cache.reserve(seg.slot, start + n)
    return starts


class Runner:
    """A decoder plus its slot KV cache.

    `query_width` (invariant mode): every forward whose segments all fit in that width is padded to
    it (rounded up to a multiple of ROW_TILE), attends over the whole static cache and computes the LM
    head on every row, so a 1-token decode and a (k+1)-token verify run the same kernel shapes and each
    row the same reduction order: their logits are bitwise equal.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        num_slots: int,
        max_len: int | None = None,
        query_width: int | None = None,
        tap_layers: Sequence[int] = (),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: tuple[int, int] = (0, 1),
        block_size: int = 16,
        num_blocks: int | None = None,
        prefix_caching: bool = False,
    ) -> None:
        """tp: (rank, world size) of a target split over ranks (common/runtime/tensor_parallel.py): this rank's shard and its
        heads' part of the KV cache. The KV cache is paged: `num_blocks` blocks of `block_size` positions (unset: as
        many as num_slots requests of max_len need), their full blocks kept for later prompts with prefix_caching (a
        hybrid's with its states where a prefill saved them: `HybridPagedKVCache`)."""
        cfg = checkpoint.config
        self.device = torch.device(device)
        self.config = cfg
        self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        # CPU GEMM computes a row identically wherever it sits once the row count is a multiple of
        # the kernel's tile (measured: 4 rows); a remainder row takes another code path.
        self.query_width = -(-query_width // ROW_TILE) * ROW_TILE if query_width else None
        self.tap_layers = tuple(tap_layers)
        self.model = target_decoder(checkpoint, dtype, self.device, self.tap_layers, tp)
        if self.device.type == "cpu":
            cpu_kernels.enabled()  # build or load the CPU kernel now, not during the first request
        num_blocks = num_blocks or num_slots * -(-self.max_len // block_size)
        if cfg.hybrid:  # KV for the attention layers, conv and recurrent states for the linear ones (this rank's heads)
            self.cache = HybridPagedKVCache(self.model.cfg, num_slots, self.max_len, num_blocks, block_size, dtype,
                                            self.device, prefix_caching)
        else:
            self.cache = PagedKVCache(cfg.num_layers, num_slots, self.model.cfg.num_kv_heads, self.max_len,
                                      cfg.head_dim, num_blocks, block_size, dtype, self.device, prefix_caching)
        self._cos_sin = tuple(t.to(self.device, dtype) for t in rope_table(cfg, self.max_len))

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight  # [vocab, hidden]

    def make_tap_buffer(self) -> torch.Tensor | None:
        """A buffer for the tap features of every position, laid out as the KV cache's blocks [blocks, block_size,
        n_taps * hidden] (a position's taps lie where its K/V do); None without tap layers."""
        width = len(self.tap_layers) * self.config.hidden_size
        if not width:
            return None
        return torch.zeros(self.cache.num_blocks, self.cache.block_size, width, dtype=self.embedding.dtype,
                           device=self.device)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight  # [vocab, hidden]

    def _width(self, lengths: list[int]) -> int:
        longest = max(lengths)
        if self.query_width and longest <= self.query_width:
            return self.query_width
        return longest

    def _index_tensors(self, segments: Sequence[Segment], lengths: list[int], starts: list[int], host_slots: list[int],
                       width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, T] (padding: 0), real [B, T] (False: padding), positions [B, T] (padding's clamped to the
        cache) and slots [B], made from host lists in two calls (tensor operations building them would be a visible
        share of a decode's forward)."""
        last, pad = self.max_len - 1, (0,) * width
        rows = [[*seg.token_ids, *pad[n:]] for seg, n in zip(segments, lengths)]
        rows += [[min(p, last) for p in range(start, start + width)] for start in starts]
        rows += [[1] * n + [0] * (width - n) for n in lengths]
        index = torch.tensor(rows, dtype=torch.long)  # [3 B, T]
        B = len(segments)
        return index[:B], index[2 * B :] != 0, index[B : 2 * B], torch.tensor(host_slots, dtype=torch.long)

    def starts(self, segments: Sequence[Segment]) -> list[int]:
        return segment_starts(self.cache, self.max_len, segments)

    def _tree(self, segments: Sequence[Segment], starts: list[int], positions: torch.Tensor,
              key_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a segment is a token tree: AttentionBatch's (rope positions, visible keys), else None."""
        if all(seg.parents is None for seg in segments):
            return None
        if self.config.hybrid:
            raise ValueError("a token tree needs a target of attention layers only: a hybrid's recurrent states "
                             "follow one sequence")
        rope = positions.clone()
        keys = torch.arange(key_len)
        visible = keys[None, None, :] <= positions[:, :, None]  # [B, T, key_len]: a sequence's causal mask
        for b, (seg, start) in enumerate(zip(segments, starts)):
            if seg.parents is None:
                continue
            n = len(seg.token_ids)
            rope[b, :n] = start + torch.tensor(seg.depths())
            visible[b, :n, start : start + n] = seg.visible()
        return rope.to(self.device), visible.to(self.device)

    def keep_path(self, slot: int, start: int, nodes: Sequence[int], tap_dest: torch.Tensor | None = None) -> None:
        """After a token tree's forward from `start`: the K/V (and the taps in tap_dest) of the tree's tokens
        `nodes` (indices into its token_ids, root to leaf, the anchor 0 first) move to positions start, start + 1, ...
        and the slot's length becomes start + len(nodes): the cache holds the path as a sequence's forward leaves it."""
        moved = [j for j, i in enumerate(nodes) if i != j]
        if moved:
            table = self.cache.table[slot : slot + 1].to(self.device)
            rows = torch.zeros(len(moved), dtype=torch.long, device=self.device)
            src = self.cache.blocks_of(table, rows, torch.tensor([start + nodes[j] for j in moved], device=self.device))
            dst = self.cache.blocks_of(table, rows, torch.tensor([start + j for j in moved], device=self.device))
            for cache in (self.cache.k, self.cache.v):  # [layers, blocks, kv_heads, block_size, hd]
                cache[:, dst[0], :, dst[1]] = cache[:, src[0], :, src[1]]  # the right side is a copy: overlaps are safe
            if tap_dest is not None:
                tap_dest[dst] = tap_dest[src]
        self.cache.set_length(slot, start + len(nodes))

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], tap_dest: torch.Tensor | None = None) -> ForwardResult:
        """Run all segments in one batched forward and advance each slot's length by its token count. tap_dest
        (`make_tap_buffer`'s): the tap features go there, where each token's K/V go, and the result's tap_rows is
        None. `OutOfBlocks` (before anything runs) where the KV cache has too few blocks for the new tokens."""
        lengths = [len(s.token_ids) for s in segments]
        starts = self.starts(segments)
        width = self._width(lengths)
        host_slots = [s.slot for s in segments]
        tokens, real, positions, slots = self._index_tensors(segments, lengths, starts, host_slots, width)
        invariant = width == self.query_width
        key_len = self.max_len if invariant else self.cache.key_span(max(s + n for s, n in zip(starts, lengths)))
        tree = self._tree(segments, starts, positions, key_len)
        if self.device.type != "cpu":  # index tensors are built on the host, then moved once
            tokens, real, positions, slots = (t.to(self.device, non_blocking=True) for t in (tokens, real, positions, slots))
        batch = AttentionBatch(self.cache, slots, positions, real, key_len, self._cos_sin, host_slots, starts, lengths,
                               tree)
        if isinstance(self.cache, HybridStates):
            batch.states = self.cache.states.begin(host_slots, starts, lengths, self.device)
        hidden, taps = self.model(tokens, batch, self.tap_layers, tap_dest)  # [B, T, H]; taps None: in tap_dest
        tap_rows = batch.real_rows(torch.cat(taps, dim=-1)) if taps else None  # [N, n_taps * H]
        if tap_rows is not None and tap_dest is not None:
            batch.store(tap_dest, tap_rows)
            tap_rows = None
        firsts = [n - 1 if seg.last_only else 0 for seg, n in zip(segments, lengths)]
        if invariant:  # [B, T, vocab]: the same row count every call
            all_logits = self.model.logits(hidden)
            logits = [all_logits[b, first:n] for b, (first, n) in enumerate(zip(firsts, lengths))]
        else:  # the rows each segment returns, through the LM head in one call (its weight read once)
            rows = [hidden[b, first:n] for b, (first, n) in enumerate(zip(firsts, lengths))]
            logits = list(self.model.logits(torch.cat(rows) if len(rows) > 1 else rows[0]).split(
                [n - first for first, n in zip(firsts, lengths)]))
        for seg, start, n in zip(segments, starts, lengths):
            self.cache.set_length(seg.slot, start + n)
        return ForwardResult(logits, tap_rows, batch.store, tuple(lengths))
