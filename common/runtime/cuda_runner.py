"""The CUDA backend of the runner interface (`runner.Runner` is the CPU one): graph-captured, sync-free steps over
static buffers, with batch-invariant operators by default.

A forward of at most max(WIDTHS) tokens per request and at most the largest batch size runs as the CUDA graph of its
bucket: the smallest batch size in `batch_sizes` and width in WIDTHS that hold it, padded. The KV cache is paged
(`kv_cache.PagedKVCache`: blocks taken as a request grows, named by a table per slot) and the tap buffer lies in the
same blocks. Each bucket owns static input buffers (tokens, positions, each row's state slot, the block each token's
K/V and tap features go to, which rows are real, and its batch size's block tables); the step reads and writes the KV
cache and the tap buffer through those device index tensors, so a replay needs host-to-device copies of the indices
and of the tables' columns in use, and one device-to-host copy of what the greedy rule decided (the number of accepted
drafts and the target's argmax of every row). Padding rows write to a spare block no request gets (and a hybrid's
states to a spare slot). Wider forwards (prefill chunks) run the same step eagerly at their own shape.

Numerics: "invariant" (the default) computes every product, norm and attention with the operators of
`gpu_kernels`, whose reduction order does not depend on the number of rows, so a row's logits are the same decoded
alone, verified in a block or batched with other requests: speculative output is token-identical to plain decoding.
"fast" uses torch's products (cuBLAS picks its kernel by the row count) and is not token-identical.

Every family: dense (Llama, Qwen2, Qwen3), their mixtures of experts (`gpu_kernels.moe`), and the Qwen3.5 / 3.6
hybrids and Qwen3-Next (`cuda_steps.HybridStaticStep`: each forward writes a slot's other state buffers and keeps what
a rollback within it replays).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import torch

from blockspec.common.kernels import gpu_kernels as gk
from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.kv_cache import PagedKVCache
from blockspec.common.models.model_config import ModelConfig
from blockspec.common.models.state_cache import HybridPagedKVCache
from blockspec.common.runtime.cuda_steps import HybridStaticStep, StaticStep
from blockspec.common.runtime.runner import ForwardResult, Segment, segment_starts, target_decoder

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 2, 4, 8, 16)  # a decode, and verifies of k + 1 tokens up to the DFlash block
NUMERICS = ("invariant", "fast")
GEMMS = ("auto", "triton", "cublas")
PREFILL_ROWS = (17, 100, 333, 512)  # prefill chunks' row counts the GEMM probe adds to the buckets'


def choose_gemm(step, gemm: str, device: torch.device, batches: Sequence[int]) -> str:
    """The products of the invariant numerics, set for this process (`gpu_kernels.use_cublas`): "triton" (the Triton
    GEMM, row-invariant by construction), "cublas" (torch's products, cuBLAS without split-K), or "auto": cuBLAS
    where a probe on the device finds it bitwise row-invariant for the step's weight shapes at every bucket's row
    count and some prefill chunks' (`gemm_choice.choose_gemm`), else Triton. Off CUDA: "triton" (the references)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm {gemm!r}: choose from {', '.join(GEMMS)}")
    if gemm == "auto":
        if device.type != "cuda":
            return "triton"
        from blockspec.common.kernels import gemm_choice

        shapes = sorted({tuple(t.shape) for t in step.weights() if t.dim() == 2})
        rows = sorted({b * w for b in batches for w in WIDTHS} | set(PREFILL_ROWS))
        choice = gemm_choice.choose_gemm(shapes, device, rows=rows)
        log.info("products: %s (%d weight shapes at %d row counts probed in %.1f s%s)", choice.chosen, len(shapes),
                 len(rows), choice.seconds, f"; {choice.mismatch}" if choice.mismatch else "")
        gemm = choice.chosen
    gk.use_cublas(gemm == "cublas")
    return gemm


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size that holds n, or None when none does."""
    return next((s for s in sizes if s >= n), None)


def batch_sizes(num_slots: int) -> tuple[int, ...]:
    """The batch buckets of a runner with num_slots slots: the powers of two below it, and num_slots itself."""
    return tuple(sorted({b for b in BATCH_SIZES if b < num_slots} | {num_slots}))


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the CUDA backend does not run this model, or None."""
    dims = {"head_dim": cfg.head_dim}
    if cfg.hybrid:
        dims.update(linear_key_head_dim=cfg.linear.k_head_dim, linear_value_head_dim=cfg.linear.v_head_dim)
    odd = [f"{name} {d}" for name, d in dims.items() if d & (d - 1)]
    return f"{', '.join(odd)} (its kernels take powers of two)" if odd else None


class Graphs:
    """CUDA graphs captured on first use, one per key, sharing one memory pool. `run(key, fn, args)` replays the key's
    graph (capturing fn(*args) first: two warm-up calls on a side stream, where kernels compile and the allocator
    settles, then the capture) and returns the outputs it recorded: static tensors, valid until the next replay.
    capture False calls fn(*args) instead (the CPU). `emulate` (the CPU tests) calls fn with the arguments of the key's
    first call every time, as a replay reads the tensors its graph was captured with (a step that read a tensor made
    outside its static buffers would compute from stale values there too), and returns the first call's output tensors
    with each call's values copied in, as a replay overwrites its outputs (a reader that kept an earlier replay's
    output, rather than copying it into a buffer of its own, would read the later one's values there too)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device, self.capture = device, capture
        self.emulate = False
        self._graphs: dict = {}
        self._pool = None

    def keys(self) -> list:
        return sorted(self._graphs)

    def run(self, key, fn, args: tuple):
        if not self.capture:
            if self.emulate:
                first_args, outputs = self._graphs.get(key, (args, None))
                fresh = fn(*first_args)
                if outputs is None:
                    self._graphs[key] = (first_args, fresh)
                    return fresh
                _copy_into(outputs, fresh)
                return outputs
            return fn(*args)
        if key not in self._graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = fn(*args)
            self._graphs[key] = (graph, outputs)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs


def _copy_into(outputs, values) -> None:
    """Each tensor of `values` (nested tuples and lists of tensors) copied into the same place of `outputs`."""
    if isinstance(outputs, torch.Tensor):
        outputs.copy_(values)
    else:
        for out, value in zip(outputs, values):
            _copy_into(out, value)


class _Tables:
    """A batch size's block tables as the steps read them, [batch, max_blocks] (a view of [max_blocks, batch]: the
    columns a forward uses are one contiguous copy), on the device and pinned on the host; the spare block at first."""

    def __init__(self, batch: int, max_blocks: int, spare_block: int, device: torch.device) -> None:
        self.columns = torch.full((max_blocks, batch), spare_block, dtype=torch.long, device=device)
        self.host = torch.full((max_blocks, batch), spare_block, dtype=torch.long, pin_memory=device.type == "cuda")
        self.rows = self.columns.t()  # [batch, max_blocks]: what the step takes

    def fill(self, cache: PagedKVCache, slots: list[int], columns: int) -> None:
        """The tables of these slots' rows (the spare block's after them), their first `columns` columns."""
        self.host[:columns] = table_columns(cache, slots, self.host.shape[1], columns)
        self.columns[:columns].copy_(self.host[:columns], non_blocking=True)


class _Bucket:
    """A bucket's static buffers and the pinned host copies of its inputs and decisions."""

    def __init__(self, batch: int, width: int, spare: int, cache: PagedKVCache, tables: _Tables,
                 device: torch.device) -> None:
        self.batch, self.width, self.tables = batch, width, tables
        pin = device.type == "cuda"
        # rows: tokens, positions, write_blocks, real (each [batch, width]), slots and reads (first column)
        self.inputs = torch.zeros((6, batch, width), dtype=torch.long, device=device)
        self.host = torch.zeros((6, batch, width), dtype=torch.long, pin_memory=pin)
        self.decided = torch.zeros((batch, width + 1), dtype=torch.long, pin_memory=pin)
        # all padding: a warm-up writes the spare block only
        self.inputs.copy_(inputs_of((), [], (batch, width), cache, spare, 1 << 30, None))

    def args(self) -> tuple[torch.Tensor, ...]:
        return (*step_args(self.inputs), self.tables.rows)


def step_args(inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The step's index arguments from its inputs [6, batch, width]: views of them, never new tensors (a graph reads
    the tensors it was captured with: a conversion made here would be stale at the next replay)."""
    tokens, positions, write_blocks, real, slots, reads = inputs.unbind(0)
    return tokens, positions, slots[:, 0], write_blocks, real, reads[:, 0]


class CudaRunner:
    """The runner interface (`forward(segments, tap_dest)` -> ForwardResult) over captured steps; see the module
    docstring. `capture` False runs the same step eagerly (what the CPU tests run)."""

    def __init__(self, checkpoint: Checkpoint, num_slots: int, max_len: int | None = None,
                 tap_layers: Sequence[int] = (), dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", numerics: str = "invariant", capture: bool | None = None,
                 warm_up: bool | None = None, gemm: str | None = None, tp: tuple[int, int] = (0, 1),
                 num_blocks: int | None = None, block_size: int = 16) -> None:
        """tp: (rank, world size) of a target split over ranks (common/runtime/tensor_parallel.py): this rank's shard,
        its heads' part of the caches, and the step's sums over the ranks inside it. The KV cache is paged: `num_blocks`
        blocks of `block_size` positions for the requests (unset: as many as num_slots requests of max_len need), one
        more where padding rows write; its prefixes are not cached."""
        cfg = checkpoint.config
        reason = unsupported(cfg)
        if reason:
            raise ValueError(f"the CUDA runner does not take {reason}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics {numerics!r}: choose from {', '.join(NUMERICS)}")
        self.device, self.config, self.numerics = torch.device(device), cfg, numerics
        self.max_len = min(max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.query_width = None
        self.tap_layers = tuple(tap_layers)
        self.model = target_decoder(checkpoint, dtype, self.device, self.tap_layers, tp)
        if tp[1] > 1:  # the step merges the shard's projections: the checkpoint's own tensors stay whole
            checkpoint = dataclasses.replace(checkpoint, weights=dict(checkpoint.weights))
        part = self.model.cfg  # this rank's heads
        num_blocks = num_blocks or num_slots * -(-self.max_len // block_size)
        if cfg.hybrid:  # the spare slot: the state row padding rows read and write
            self.cache = HybridPagedKVCache(part, num_slots, self.max_len, num_blocks, block_size, dtype, self.device,
                                            spare_slots=1, spare_blocks=1, step_width=max(WIDTHS))
        else:
            self.cache = PagedKVCache(cfg.num_layers, num_slots, part.num_kv_heads, self.max_len, cfg.head_dim,
                                      num_blocks, block_size, dtype, self.device, prefix_caching=False, spare_blocks=1)
        width = len(self.tap_layers) * cfg.hidden_size
        self.tap_buffer = (torch.zeros(num_blocks + 1, block_size, width, dtype=dtype, device=self.device)
                           if width else None)
        self.step = (HybridStaticStep if cfg.hybrid else StaticStep)(
            self.model, checkpoint, self.cache, self.tap_layers, self.tap_buffer, numerics, self.max_len)
        self.graphs = Graphs(self.device, self.device.type == "cuda" if capture is None else capture)
        self.batch_sizes = batch_sizes(num_slots)
        # the products of the invariant numerics, chosen before any capture (BLOCKSPEC_GEMM: auto, triton, cublas)
        self.gemm = (choose_gemm(self.step, gemm or os.environ.get("BLOCKSPEC_GEMM", "auto"), self.device,
                                 self.batch_sizes) if numerics == "invariant" else "torch")
        self.spare = num_slots
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._tables: dict[int, _Tables] = {}
        if self.graphs.capture if warm_up is None else warm_up:
            self.warm_up()

    def starts(self, segments: Sequence[Segment]) -> list[int]:
        return segment_starts(self.cache, self.max_len, segments)

    @staticmethod
    def graph_bytes(cfg: ModelConfig, num_slots: int, max_len: int = 0, block_size: int = 16) -> int:
        """What the captured steps keep between replays: each bucket's outputs (fp32 logits of every row and the greedy
        decision) and each batch size's block tables (max_len / block_size columns). The intermediates live in the
        graphs' shared pool, reused from one graph to the next, and are not counted."""
        rows = sum(batch_sizes(num_slots)) * sum(WIDTHS)  # every (batch, width) bucket's rows
        tables = sum(batch_sizes(num_slots)) * -(-max_len // block_size) * 8
        return (rows * cfg.vocab_size * 4 + sum(b * (w + 1) for b in batch_sizes(num_slots) for w in WIDTHS) * 8
                + tables)

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def make_tap_buffer(self) -> torch.Tensor | None:
        """The tap buffer the captured steps write, in the KV cache's blocks ([blocks + spare, block_size, n_taps *
        hidden]: a position's taps lie where its K/V do)."""
        return self.tap_buffer

    def bucket_of(self, batch: int, width: int) -> tuple[int, int] | None:
        """The (batch size, width) of the graph a forward of `batch` segments of at most `width` tokens replays, or
        None (it runs eagerly)."""
        b, w = bucket(batch, self.batch_sizes), bucket(width, WIDTHS)
        return None if b is None or w is None else (b, w)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every bucket now (its step over padding rows, which write the spare block only), so that no request
        waits for a capture or a kernel's compilation."""
        started = time.perf_counter()
        for key in ((b, w) for b in self.batch_sizes for w in WIDTHS):
            self.graphs.run(key, self.step, self._bucket(key).args())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("captured %d steps in %.1f s", len(self.graphs.keys()), time.perf_counter() - started)

    def _bucket(self, key: tuple[int, int]) -> _Bucket:
        if key not in self._buckets:
            batch = key[0]
            if batch not in self._tables:
                self._tables[batch] = _Tables(batch, self.cache.max_blocks, self.cache.spare_block, self.device)
            self._buckets[key] = _Bucket(*key, self.spare, self.cache, self._tables[batch], self.device)
        return self._buckets[key]

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], tap_dest: torch.Tensor | None = None) -> ForwardResult:
        """As `Runner.forward`; the result also carries each segment's greedy decision (`ForwardResult.greedy`). The
        tap features go to this runner's tap buffer (tap_dest must be it, or None)."""
        if tap_dest is not None and tap_dest is not self.tap_buffer:
            raise ValueError("the CUDA runner stores tap features in its own buffer (make_tap_buffer)")
        if any(s.parents is not None for s in segments):
            raise ValueError("the CUDA runner verifies sequences: a token tree (Segment.parents) runs on the eager "
                             "runner (backend eager)")
        lengths = [len(s.token_ids) for s in segments]
        starts = self.starts(segments)
        key = self.bucket_of(len(segments), max(lengths))
        firsts = [n - 1 if s.last_only else 0 for s, n in zip(segments, lengths)]
        ends = list(lengths)
        states = getattr(self.cache, "states", None)
        if states is not None:
            states.flush()  # the rollbacks since the last forward, in one launch
        slots = [s.slot for s in segments]
        if key is not None:
            bucket = self._bucket(key)
            bucket.host.copy_(inputs_of(segments, starts, key, self.cache, self.spare, self.max_len, states))
            bucket.inputs.copy_(bucket.host, non_blocking=True)
            bucket.tables.fill(self.cache, slots, self.table_width(starts, key[1]))
            logits, decided = self.graphs.run(key, self.step, bucket.args())
            host = bucket.decided
            host.copy_(decided, non_blocking=True)
        else:  # eager at the forward's own shape; of a prefill (every segment last_only) the last rows' logits only
            shape = (len(segments), max(lengths))
            inputs = inputs_of(segments, starts, shape, self.cache, self.spare, self.max_len, states).to(self.device)
            tables = table_columns(self.cache, slots, len(segments), self.table_width(starts, shape[1]))
            args = (*step_args(inputs), tables.to(self.device).t())
            last = None
            if all(s.last_only for s in segments):
                last = torch.tensor([n - 1 for n in lengths], device=self.device)
                firsts, ends = [0] * len(segments), [1] * len(segments)
            logits, decided = self.step(*args, last)
            host = decided.to("cpu", non_blocking=True)
        if states is not None:  # the other buffers are current now
            for seg, start, n in zip(segments, starts, lengths):
                states.keep(seg.slot, start, n, max(lengths))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the step's one wait: its decisions are on the host
        rows = host.tolist()
        for seg, start, n in zip(segments, starts, lengths):
            self.cache.set_length(seg.slot, start + n)
        return ForwardResult([logits[b, first:end] for b, (first, end) in enumerate(zip(firsts, ends))], None, None,
                             tuple(lengths), [(row[0], row[1 + first : 1 + end])
                                              for row, first, end in zip(rows, firsts, ends)])

    def table_width(self, starts: list[int], width: int) -> int:
        """The block-table columns a forward of rows starting at `starts`, `width` wide, reads: every position it
        attends from (a padding column's too) lies in them."""
        return min(self.cache.max_blocks, self.cache.blocks_for(max(starts, default=0) + width))


def table_columns(cache: PagedKVCache, slots: list[int], batch: int, columns: int) -> torch.Tensor:
    """The block tables of a forward's rows as columns [columns, batch] on the host: these slots' rows first, padding
    rows' (the spare block) after them."""
    out = torch.full((columns, batch), cache.spare_block, dtype=torch.long)
    if slots:
        out[:, : len(slots)] = cache.table[slots, :columns].t()
    return out


def inputs_of(segments: Sequence[Segment], starts: list[int], shape: tuple[int, int], cache: PagedKVCache,
              spare: int, max_len: int, states=None) -> torch.Tensor:
    """The step's index inputs [6, batch, width] on the host: tokens, positions, the block each token's K/V and tap
    features go to (the cache's spare block for padding), real flags, each row's state slot (`spare` for padding rows)
    and (a hybrid's `states`) its current state buffer, the last two repeated along the width. Built from lists in
    one call; the segments' blocks are reserved."""
    batch, width = shape
    tokens, positions, writes, real, slots = [], [], [], [], []
    pad = [0] * width
    shift = cache.block_shift
    for b in range(batch):
        if b < len(segments):
            seg, start = segments[b], starts[b]
            n = len(seg.token_ids)
            held = cache.held[seg.slot]
            tokens.append([*seg.token_ids, *pad[n:]])
            positions.append([min(p, max_len - 1) for p in range(start, start + width)])
            writes.append([held[p >> shift] for p in range(start, start + n)] + [cache.spare_block] * (width - n))
            real.append([1] * n + pad[n:])
            slots.append([seg.slot] * width)
        else:
            tokens.append(pad)
            positions.append(list(range(width)))
            writes.append([cache.spare_block] * width)
            real.append(pad)
            slots.append([spare] * width)
    reads = [[states.current[row[0]]] * width if states is not None else pad for row in slots]
    return torch.tensor([tokens, positions, writes, real, slots, reads], dtype=torch.long)
