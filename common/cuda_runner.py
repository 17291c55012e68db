"""The CUDA backend of the runner interface (`runner.Runner` is the CPU one): graph-captured, sync-free steps over
static buffers, with batch-invariant operators by default.

A forward of at most max(WIDTHS) tokens per request and at most the largest batch size runs as the CUDA graph of its
bucket: the smallest batch size in `batch_sizes` and width in WIDTHS that hold it, padded. Each bucket owns static
input buffers (tokens, positions, slots, the slot each row's K/V and tap features go to, which rows are real); the
step reads and writes the KV cache and the tap buffer through those device index tensors, so a replay needs one
host-to-device copy of the indices and one device-to-host copy of what the greedy rule decided (the number of
accepted drafts and the target's argmax of every row). Padding rows write to a spare slot no request owns. Wider
forwards (prefill chunks) run the same step eagerly at their own shape.

Numerics: "invariant" (the default) computes every product, norm and attention with the operators of
`gpu_kernels`, whose reduction order does not depend on the number of rows, so a row's logits are the same decoded
alone, verified in a block or batched with other requests: speculative output is token-identical to plain decoding.
"fast" uses torch's products (cuBLAS picks its kernel by the row count) and is not token-identical.

Dense families (Llama, Qwen2, Qwen3). Hybrid and MoE targets run on `runner.Runner` on every device.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.common import gpu_kernels as gk
from blockspec.common.decoder import Decoder, rope_table
from blockspec.common.kv_cache import SlotKVCache
from blockspec.common.models import Checkpoint, ModelConfig
from blockspec.common.runner import ForwardResult, Segment, build_decoder

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTHS = (1, 2, 4, 8, 16)  # a decode, and verifies of k + 1 tokens up to the DFlash block
NUMERICS = ("invariant", "fast")


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size that holds n, or None when none does."""
    return next((s for s in sizes if s >= n), None)


def batch_sizes(num_slots: int) -> tuple[int, ...]:
    """The batch buckets of a runner with num_slots slots: the powers of two below it, and num_slots itself."""
    return tuple(sorted({b for b in BATCH_SIZES if b < num_slots} | {num_slots}))


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the CUDA backend does not run this model, or None."""
    if cfg.hybrid:
        return "hybrid (Gated DeltaNet) layers"
    if cfg.experts is not None:
        return "mixture-of-experts layers"
    if cfg.head_dim & (cfg.head_dim - 1):
        return f"head_dim {cfg.head_dim} (the attention kernel takes powers of two)"
    return None


class StaticStep(nn.Module):
    """One forward of a dense decoder written for capture: static shapes, no host value read, every index on the
    device. The q/k/v and gate/up weights are merged at build (the decoder's own parameters become views of them)."""

    def __init__(self, model: Decoder, checkpoint: Checkpoint, cache: SlotKVCache, tap_layers: tuple[int, ...],
                 tap_dest: torch.Tensor | None, numerics: str, max_len: int) -> None:
        super().__init__()
        cfg = self.cfg = model.cfg
        self.cache, self.tap_layers, self.tap_dest = cache, tap_layers, tap_dest
        self.linear = gk.linear if numerics == "invariant" else torch.ops.aten.linear.default
        self.add_norm = gk.add_rms_norm if numerics == "invariant" else gk.add_rms_norm_reference
        self.scale = gk.attention_scale(cfg.head_dim)
        dtype, device = model.embed_tokens.weight.dtype, model.embed_tokens.weight.device
        self.cos, self.sin = (t.to(device, dtype) for t in rope_table(cfg, max_len))
        self.embed = model.embed_tokens.weight
        self.layers = []
        for i, layer in enumerate(model.layers):
            att, mlp = layer.self_attn, layer.mlp
            qkv = merge(checkpoint, model, i, att, ("q_proj", "k_proj", "v_proj"))
            gate_up = merge(checkpoint, model, i, mlp, ("gate_proj", "up_proj"))
            bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]) if cfg.qkv_bias else None
            empty = self.embed.new_empty(0)
            self.layers.append((layer.input_layernorm.weight, qkv, bias,
                                att.q_norm.weight if cfg.qk_norm else empty, att.k_norm.weight if cfg.qk_norm else empty,
                                att.o_proj, layer.post_attention_layernorm.weight, gate_up, mlp))
        self.final_norm, self.lm_head = model.norm.weight, model.lm_head.weight

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.linear(x, weight)
        return y if bias is None else y + bias

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, write_slots: torch.Tensor,
                real: torch.Tensor, last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions, write_slots, real [B, T]; slots [B]; last [B] (optional): return only that row of each.
        -> fp32 logits [B, T or 1, vocab] and the greedy decision [B, T + 1] (int64): column 0 the drafts a greedy
        verify of [anchor, d1..] accepts, then the argmax of every row. K/V and tap features are stored at
        (write_slots, positions)."""
        cfg = self.cfg
        B, T = tokens.shape
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        x = F.embedding(tokens, self.embed)  # [B, T, hidden]
        h, residual = self.add_norm(x, torch.zeros_like(x), self.layers[0][0], eps)
        taps = []
        n = len(self.layers)
        for i, (_, qkv_w, qkv_b, q_norm, k_norm, o_proj, post_norm, gate_up, mlp) in enumerate(self.layers):
            qkv = self._proj(h, qkv_w, qkv_b).view(B, T, H + 2 * KV, D)
            qk = gk.qk_norm_rope(qkv, q_norm, k_norm, self.cos, self.sin, positions, H, KV, eps)  # [B, T, H + KV, D]
            kc, vc = self.cache.k[i], self.cache.v[i]  # [slots, KV, max_len, D]
            kc[write_slots, :, positions] = qk[:, :, H:]
            vc[write_slots, :, positions] = qkv[:, :, H + KV :]
            att = gk.cache_attention(qk[:, :, :H], kc, vc, slots, positions, self.scale)  # [B, T, H, D]
            h, residual = self.add_norm(self._proj(att.reshape(B, T, H * D), o_proj.weight, o_proj.bias), residual,
                                        post_norm, eps)
            gu = self._proj(h, gate_up, None if not cfg.mlp_bias else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]))
            gate, up = gu.chunk(2, dim=-1)
            down = self._proj(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
            h, residual = self.add_norm(down, residual, self.layers[i + 1][0] if i + 1 < n else self.final_norm, eps)
            if i in self.tap_layers:
                taps.append(residual)  # the layer's output
        if taps and self.tap_dest is not None:
            self.tap_dest[write_slots, positions] = torch.cat(taps, dim=-1)
        if last is not None:
            h = h[torch.arange(B, device=h.device), last].unsqueeze(1)  # [B, 1, hidden]
        logits = self.linear(h, self.lm_head).float()  # [B, T', vocab]
        top = logits.argmax(dim=-1)  # [B, T']
        if last is None:  # greedy verify of [anchor, d1..]: drafts accepted while equal to the target's argmax
            agree = (top[:, :-1] == tokens[:, 1:]) & real[:, 1:]
            accepted = agree.long().cumprod(dim=1).sum(dim=1, keepdim=True)
        else:
            accepted = torch.zeros_like(top[:, :1])
        return logits, torch.cat((accepted, top), dim=1)


def merge(checkpoint: Checkpoint, model: Decoder, layer: int, module: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The weights of module's projections `names` as one [sum of outputs, in] tensor; each projection's parameter
    (and the checkpoint's tensor of it) becomes a view of it, so the merged weight is not held twice."""
    parts = [getattr(module, name).weight for name in names]
    base = parts[0]._base
    if base is not None and base.shape[0] == sum(p.shape[0] for p in parts) and all(
            p._base is base and p.data_ptr() == base[offset:].data_ptr()
            for p, offset in zip(parts, itertools.accumulate([0, *(p.shape[0] for p in parts[:-1])]))):
        return base  # merged by a runner before this one over the same checkpoint
    merged = torch.cat(parts)
    offset = 0
    prefix = next((f"{p}layers.{layer}." for p in ("model.", "") if f"{p}layers.{layer}.input_layernorm.weight"
                   in checkpoint.weights), None)
    for name, part in zip(names, parts):
        view = merged[offset : offset + part.shape[0]]
        getattr(module, name).weight = nn.Parameter(view, requires_grad=False)
        if prefix is not None:
            for key in [k for k in checkpoint.weights if k.startswith(prefix) and k.endswith(f".{name}.weight")]:
                checkpoint.weights[key] = view
        offset += part.shape[0]
    return merged


class Graphs:
    """CUDA graphs captured on first use, one per key, sharing one memory pool. `run(key, fn, args)` replays the key's
    graph (capturing fn(*args) first: two warm-up calls on a side stream, where kernels compile and the allocator
    settles, then the capture) and returns the outputs it recorded: static tensors, valid until the next replay.
    capture False calls fn(*args) instead (the CPU)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device, self.capture = device, capture
        self._graphs: dict = {}
        self._pool = None

    def keys(self) -> list:
        return sorted(self._graphs)

    def run(self, key, fn, args: tuple):
        if not self.capture:
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


class _Bucket:
    """A bucket's static buffers and the pinned host copies of its inputs and decisions."""

    def __init__(self, batch: int, width: int, spare: int, device: torch.device) -> None:
        self.batch, self.width = batch, width
        pin = device.type == "cuda"
        # rows: tokens, positions, write_slots, real (each [batch, width]), slots (first column)
        self.inputs = torch.zeros((5, batch, width), dtype=torch.long, device=device)
        self.host = torch.zeros((5, batch, width), dtype=torch.long, pin_memory=pin)
        self.decided = torch.zeros((batch, width + 1), dtype=torch.long, pin_memory=pin)
        self.inputs.copy_(inputs_of((), [], (batch, width), spare, 1 << 30))  # all padding: warm-up writes spare

    def args(self) -> tuple[torch.Tensor, ...]:
        tokens, positions, write_slots, real, slots = self.inputs.unbind(0)
        return tokens, positions, slots[:, 0], write_slots, real.bool()


class CudaRunner:
    """The runner interface (`forward(segments, tap_dest)` -> ForwardResult) over captured steps; see the module
    docstring. `capture` False runs the same step eagerly (what the CPU tests run)."""

    spare_slots = 1

    def __init__(self, checkpoint: Checkpoint, num_slots: int, max_len: int | None = None,
                 tap_layers: Sequence[int] = (), dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", numerics: str = "invariant", capture: bool | None = None) -> None:
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
        bad = [layer for layer in self.tap_layers if not 0 <= layer < cfg.num_layers]
        if bad:
            raise ValueError(f"tap layers {bad} outside the target's {cfg.num_layers} layers")
        self.model = build_decoder(checkpoint, dtype).to(self.device)
        self.cache = SlotKVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, self.max_len, cfg.head_dim, dtype,
                                 self.device, spare_slots=self.spare_slots)
        width = len(self.tap_layers) * cfg.hidden_size
        self.tap_buffer = (torch.zeros(num_slots + self.spare_slots, self.max_len, width, dtype=dtype,
                                       device=self.device) if width else None)
        self.step = StaticStep(self.model, checkpoint, self.cache, self.tap_layers, self.tap_buffer, numerics,
                               self.max_len)
        self.graphs = Graphs(self.device, self.device.type == "cuda" if capture is None else capture)
        self.batch_sizes = batch_sizes(num_slots)
        self.spare = num_slots
        self._buckets: dict[tuple[int, int], _Bucket] = {}

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def make_tap_buffer(self) -> torch.Tensor | None:
        """The tap buffer the captured steps write ([slots + spare, max_len, n_taps * hidden])."""
        return self.tap_buffer

    def bucket_of(self, batch: int, width: int) -> tuple[int, int] | None:
        """The (batch size, width) of the graph a forward of `batch` segments of at most `width` tokens replays, or
        None (it runs eagerly)."""
        b, w = bucket(batch, self.batch_sizes), bucket(width, WIDTHS)
        return None if b is None or w is None else (b, w)

    def _bucket(self, key: tuple[int, int]) -> _Bucket:
        if key not in self._buckets:
            self._buckets[key] = _Bucket(*key, self.spare, self.device)
        return self._buckets[key]

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], tap_dest: torch.Tensor | None = None) -> ForwardResult:
        """As `Runner.forward`; the result also carries each segment's greedy decision (`ForwardResult.greedy`). The
        tap features go to this runner's tap buffer (tap_dest must be it, or None)."""
        if tap_dest is not None and tap_dest is not self.tap_buffer:
            raise ValueError("the CUDA runner stores tap features in its own buffer (make_tap_buffer)")
        lengths = [len(s.token_ids) for s in segments]
        starts = [self.cache.lengths[s.slot] for s in segments]
        for seg, start, n in zip(segments, starts, lengths):
            if n < 1 or start + n > self.max_len:
                raise ValueError(f"slot {seg.slot}: {n} tokens at position {start} do not fit max_len {self.max_len}")
        key = self.bucket_of(len(segments), max(lengths))
        firsts = [n - 1 if s.last_only else 0 for s, n in zip(segments, lengths)]
        ends = list(lengths)
        if key is not None:
            bucket = self._bucket(key)
            bucket.host.copy_(inputs_of(segments, starts, key, self.spare, self.max_len))
            bucket.inputs.copy_(bucket.host, non_blocking=True)
            logits, decided = self.graphs.run(key, self.step, bucket.args())
            host = bucket.decided
            host.copy_(decided, non_blocking=True)
        else:  # eager at the forward's own shape; of a prefill (every segment last_only) the last rows' logits only
            shape = (len(segments), max(lengths))
            tokens, positions, write_slots, real, slots = inputs_of(segments, starts, shape, self.spare,
                                                                    self.max_len).to(self.device).unbind(0)
            last = None
            if all(s.last_only for s in segments):
                last = torch.tensor([n - 1 for n in lengths], device=self.device)
                firsts, ends = [0] * len(segments), [1] * len(segments)
            logits, decided = self.step(tokens, positions, slots[:, 0], write_slots, real.bool(), last)
            host = decided.to("cpu", non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the step's one wait: its decisions are on the host
        rows = host.tolist()
        for seg, start, n in zip(segments, starts, lengths):
            self.cache.set_length(seg.slot, start + n)
        return ForwardResult([logits[b, first:end] for b, (first, end) in enumerate(zip(firsts, ends))], None, None,
                             tuple(lengths), [(row[0], row[1 + first : 1 + end])
                                              for row, first, end in zip(rows, firsts, ends)])


def inputs_of(segments: Sequence[Segment], starts: list[int], shape: tuple[int, int], spare: int,
              max_len: int) -> torch.Tensor:
    """The step's index inputs [5, batch, width] on the host: tokens, positions, the slot each row writes (the spare
    slot for padding), real flags and each row's slot (repeated along the width). Built from lists in one call."""
    batch, width = shape
    tokens, positions, writes, real, slots = [], [], [], [], []
    pad = [0] * width
    for b in range(batch):
        if b < len(segments):
            seg, start = segments[b], starts[b]
            n = len(seg.token_ids)
            tokens.append([*seg.token_ids, *pad[n:]])
            positions.append([min(p, max_len - 1) for p in range(start, start + width)])
            writes.append([seg.slot] * n + [spare] * (width - n))
            real.append([1] * n + pad[n:])
            slots.append([seg.slot] * width)
        else:
            tokens.append(pad)
            positions.append(list(range(width)))
            writes.append([spare] * width)
            real.append(pad)
            slots.append([spare] * width)
    return torch.tensor([tokens, positions, writes, real, slots], dtype=torch.long)
