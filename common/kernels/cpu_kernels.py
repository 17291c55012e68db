"""The CPU fast path: a small-batch linear layer (y = x @ w.T for up to 256 rows, reading each weight once) and
the decoder's other operations in C++ (`cpu_shared.cpp`, `cpu_kernels.cpp`).

Decoding is a matrix-vector product per layer and a verify step a product with k + 1 rows: memory-bound shapes
where MKL's fp32 product reads the weights several times slower than a plain copy of them. The kernel streams each
weight once and stays ahead of MKL up to 256 rows on the default target's shapes
(`tests/common/kernels/test_cpu_kernels.py` checks its results; docs/performance.md says how to measure it).

* Layout: each weight is copied once, packed in panels of 64 output features ([O / 64, I, 64]), so the kernel
  streams a panel contiguously and computes it for every row of x while it sits in cache (8 rows at a time over the
  whole panel; from 16 rows on, half panels x 9-12 rows, which keep their sums in registers).
* Determinism: every output element is the sum over the input features in order, one fused multiply-add per step,
  whatever the row count and the thread split. A row's result does not depend on the batch it sits in (a 1-token
  decode and a (k+1)-token verify agree bitwise on these layers), and fused projections (q, k, v together) give
  exactly what each projection gives alone.
* Scope: fp32 CPU inference on a module's own parameters, at most MAX_ROWS rows, output features a multiple of 64.
  Anything else (training, prefill chunks over 256 tokens, GPU, bf16, a tensor shared from another process) goes to
  torch's linear. The packed copies count against a per-process budget ($BLOCKSPEC_CPU_KERNELS_MAX_MB, 1024 MiB):
  a model too big to hold twice keeps torch's linear.
* Also here, each one call where torch runs several operations with their dispatch: `rms_norm` and `qk_norm_rope`
  (the decoder's norms, its q/k norm with RoPE); `cached_attention`, attention of decode and verify steps and
  prefill chunks (at most ATTENTION_MAX_QUERIES queries per row) over the slot KV cache read in place, where SDPA
  needs the keys gathered and a mask built; `argmax_rows`, the row argmax of a verify's logits; `decoder_rows`, a
  decoder's layers over rows of real tokens in one call (the same kernels and arithmetic as the module path,
  bitwise, without its Python and dispatch); `silu_mul`, the MLP's silu(gate) * up in one pass with torch's own
  exp (bitwise the two torch operations).
* Switch: BLOCKSPEC_CPU_KERNELS=0 (or `set_enabled(False)`) turns the kernel off.
* Build: compiled on first use by torch's C++ extension loader (g++ and ninja, under a minute), then cached in
  torch's extension directory (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) under a name keyed by
  `build_key`. Where it cannot be built, torch's linear is used and the log says so once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MAX_ROWS = 256  # above this (prefill chunks), torch's linear: not measured to lose, not measured to win
# cached_attention up to this many queries per row; more go to SDPA, whose blocked kernel gains from long rows (in
# place is faster up to here, no faster beyond)
ATTENTION_MAX_QUERIES = 256
ENV_SWITCH = "BLOCKSPEC_CPU_KERNELS"  # "0" turns the kernel off (torch's linear everywhere)
ENV_BUDGET = "BLOCKSPEC_CPU_KERNELS_MAX_MB"  # packed copies per process, MiB (default 1024)

_HERE = Path(__file__).parent
# The shared C++ (packed linear, attention over a KV head) every extension source starts with.
PANEL_SOURCE = (_HERE / "cpu_shared.cpp").read_text()

_SOURCE = PANEL_SOURCE + (_HERE / "cpu_sample.cpp").read_text() + (_HERE / "cpu_kernels.cpp").read_text()

_lock = threading.Lock()
_state = {"switch": os.environ.get(ENV_SWITCH, "1") != "0"}
_packs: dict[tuple[int, ...], tuple] = {}  # ids of weights -> (weakrefs, versions, packed copy)
_budget = {"left": int(os.environ.get(ENV_BUDGET, "1024")) * 2**20}  # bytes of packed copies still allowed


CFLAGS = ("-O3", "-march=native", "-fopenmp")


def build_key(source: str, cflags: Sequence[str] = CFLAGS) -> str:
    """What a build depends on, as a short digest: the source, the flags, the torch (version and installation: its
    headers' path is in the build's command line) and Python it builds against, and the CPU that -march=native
    targets. Each key gets its own directory in torch's extension cache, so two environments (another venv, another
    torch, another machine sharing a home directory) never rebuild each other's kernels: each builds its own once."""
    import platform
    import sys

    flags = next((line for line in _cpuinfo().splitlines() if line.startswith(("flags", "Features"))), "")
    parts = (source, " ".join(cflags), torch.__version__, os.path.dirname(torch.__file__), sys.version.split()[0],
             platform.machine(), flags)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: the machine name alone keys the CPU
        return ""


class Extension:
    """A C++ extension built with this module's flags on first use (or loaded from torch's cache, under a name
    keyed by `build_key`). `get()` is None while the kernels are switched off, or for good, logged once with what
    is used instead (`fallback`), where it cannot be built. Sources start from PANEL_SOURCE to use `linear_into`."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = f"{name}_{build_key(source)}", source, fallback
        self.module, self.failed = None, False

    def get(self):
        if not _state["switch"]:
            return None
        if self.module is None and not self.failed:
            with _lock:
                if self.module is None and not self.failed:
                    self.module = self._build()
                    self.failed = self.module is None
        return self.module

    def _build(self):
        try:
            from torch.utils.cpp_extension import load_inline

            with self._build_lock():
                return load_inline(self.name, cpp_sources=self.source, extra_cflags=list(CFLAGS),
                                   extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
            log.warning("CPU kernel %s unavailable, using %s: %s", self.name, self.fallback, exc)
            return None

    @contextlib.contextmanager
    def _build_lock(self):
        """One process at a time builds or loads this extension, under an flock the OS drops when its holder dies.
        torch's own lock is a file in the build directory that a build killed midway leaves behind, and every later
        process would wait on it forever; under the flock no live process holds it, so a leftover one is removed."""
        from torch.utils import cpp_extension

        directory = Path(cpp_extension._get_build_directory(self.name, verbose=False))
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory.parent / f"{self.name}.flock", "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("CPU kernel %s: waiting for another process that builds it", self.name)
                fcntl.flock(handle, fcntl.LOCK_EX)
            leftover = directory / "lock"
            if leftover.exists():
                log.warning("CPU kernel %s: removing %s, left by a build that did not finish", self.name, leftover)
                leftover.unlink()
            yield


_kernels = Extension("blockspec_cpu_kernels", _SOURCE, "torch's linear")


def set_enabled(on: bool) -> None:
    """Turn the kernels on or off for this process (the default comes from $BLOCKSPEC_CPU_KERNELS)."""
    _state["switch"] = on


def enabled() -> bool:
    return _kernels.get() is not None


FORMS = {"fp32": 4, "bf16": 2, "int8": 1}  # packed weight formats: bytes per weight (int8: and 4 per output feature)


def packed(weights: tuple[torch.Tensor, ...], form: str = "fp32") -> torch.Tensor | None:
    """cat(weights) [O, I] packed for a kernel (`_pack`): a copy, made once per set of weights and format (again
    if one is modified in place). None once the process's budget of copies is spent: a model too big to hold
    twice keeps torch's linear."""
    key = (form, *(id(w) for w in weights))
    entry = _packs.get(key)
    if (entry is None or any(ref() is not w for ref, w in zip(entry[0], weights))
            or entry[1] != tuple(w._version for w in weights)):
        size = sum(w.numel() * FORMS[form] + (4 * w.shape[0] if form == "int8" else 0) for w in weights)
        with _lock:
            if entry is not None:
                _budget["left"] += entry[2].numel() * entry[2].element_size()
            if size > _budget["left"]:
                _packs.pop(key, None)
                return None
            _budget["left"] -= size

        def drop(_, key=key, size=size) -> None:
            if _packs.pop(key, None) is not None:
                _budget["left"] += size

        entry = (tuple(weakref.ref(w, drop) for w in weights), tuple(w._version for w in weights),
                 _pack(torch.cat([w.detach() for w in weights]), form))
        _packs[key] = entry
    return entry[2]


def _pack(w: torch.Tensor, form: str = "fp32") -> torch.Tensor:
    """fp32: [O / 64, I, 64] (this kernel's panels). bf16: rounded to bfloat16, [O / 64, I / 2, 64, 2]; int8: each
    output feature's weights over its max |w| / 127, rounded, [O / 64, I / 4 + 1, 64, 4], the last row of a panel
    its 64 scales as fp32 bytes (the drafter's kernels, dflash/cpu_bf16.cpp)."""
    out_features, in_features = w.shape
    panels = out_features // 64
    if form == "bf16":
        return w.to(torch.bfloat16).reshape(panels, 64, in_features // 2, 2).transpose(1, 2).contiguous()
    if form == "int8":
        scale = w.abs().amax(1) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        q = q.reshape(panels, 64, in_features // 4, 4).transpose(1, 2)
        return torch.cat([q, scale.reshape(panels, 64).contiguous().view(torch.int8).reshape(panels, 1, 64, 4)], 1)
    return w.reshape(panels, 64, in_features).transpose(1, 2).contiguous()


def _applies(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> int:
    """The row count of x when the kernel applies to it and these weights, else 0."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or not enabled():
        return 0
    return rows if kernel_weights(weights) else 0


def kernel_weights(weights: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel takes these weights: fp32 parameters of a module (a tensor mapped from another process,
    such as the target's LM head in a remote drafter, is never copied), whole panels of 64 output features, no
    autograd."""
    return all(isinstance(w, nn.Parameter) and w.dtype == torch.float32 and not w.shape[0] % 64
               and not (w.requires_grad and torch.is_grad_enabled()) for w in weights)


def _kernel_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                   biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """x @ cat(weights).T (+ the biases) through the kernel; None where it does not apply."""
    panels = packed(weights) if (rows := _applies(x, weights)) else None
    if panels is None:
        return None
    y = _kernels.module.small_linear(x.reshape(rows, x.shape[-1]).contiguous(), panels)
    y = y.view(*x.shape[:-1], y.shape[-1])
    if all(b is None for b in biases):
        return y
    return y + torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def packed_linear(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x [N, I] (fp32, contiguous, N <= MAX_ROWS) @ w.T for w's fp32 panels from `packed`: the kernel `linear` calls."""
    return _kernels.module.small_linear(x, panels)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the small-batch kernel where it applies (CPU, fp32, inference, <= MAX_ROWS rows)."""
    y = _kernel_linear(x, (weight,), (bias,))
    return F.linear(x, weight, bias) if y is None else y


def fused_linear(x: torch.Tensor, layers: Sequence[nn.Linear]) -> torch.Tensor:
    """cat([layer(x) for layer in layers], -1) in one pass over their weights where the kernel applies.
    Every output element is computed exactly as the layer alone would compute it."""
    y = _kernel_linear(x, tuple(layer.weight for layer in layers), [layer.bias for layer in layers])
    return torch.cat([F.linear(x, layer.weight, layer.bias) for layer in layers], dim=-1) if y is None else y


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def attends_in_place(cache: torch.Tensor, queries: int) -> bool:
    """Whether `cached_attention` applies to a forward of `queries` tokens per row over this KV cache
    [layers, slots, kv_heads, max_len, head_dim]: CPU, fp32, head_dim 16, 32, 64, 128 or 256, at most
    ATTENTION_MAX_QUERIES (decode and verify steps, short prefill chunks; longer chunks go to SDPA), inference
    (no autograd)."""
    return (cache.device.type == "cpu" and cache.dtype == torch.float32 and cache.shape[-1] in (16, 32, 64, 128, 256)
            and queries <= ATTENTION_MAX_QUERIES and not torch.is_grad_enabled() and enabled())


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, shift: int) -> torch.Tensor:
    """Causal attention over one layer's cache, read in place: q [B, heads, T, hd], k_cache / v_cache
    [blocks, kv_heads, block_len, hd], tables [B, nb] (row b's position p lies in block tables[b, p >> shift] at
    p & (2^shift - 1); `kv_cache` caches give both), positions [B, T] (query (b, t) sees keys 0..positions[b, t];
    grouped heads share a KV head) -> [B, T, heads * hd], scale 1 / sqrt(hd). What SDPA with the causal mask computes,
    within fp32 rounding (a degree-7 exp; every query on its own, so a row's result does not depend on its batch or
    on where its blocks lie). Call where `attends_in_place` holds."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    return _kernels.module.cached_attention(q, k_cache, v_cache, tables, positions, q.shape[-1] ** -0.5, shift)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [..., 2 F] (gate the first half), bitwise: for fp32 on the CPU in inference one
    C++ pass with torch's own exp (F a multiple of 32, the widths torch computes in vectors), else those two
    operations. The decoder's MLP on both its paths."""
    if (gate_up.dtype == torch.float32 and gate_up.is_cpu and enabled()
            and not (gate_up.requires_grad and torch.is_grad_enabled())):
        return _kernels.module.silu_mul(gate_up if gate_up.is_contiguous() else gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


NO_WEIGHT = torch.empty(0)  # qk_norm_rope: rotate without a norm


def _norms_apply(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the norm kernels apply: fp32 on the CPU, inference (no autograd), rows of a multiple of 16."""
    return (x.dtype == torch.float32 and x.is_cpu and x.shape[-1] % 16 == 0 and enabled()
            and all(w.dtype == torch.float32 for w in weights)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (weight [D], fp32) in one C++ call; None where
    the kernel does not apply. The transformers arithmetic in fp32, the sum of squares in another order
    (within a few ulp of torch's)."""
    if not _norms_apply(x, weight):
        return None
    return _kernels.module.rms_norm_rows(x if x.is_contiguous() else x.contiguous(), weight, eps)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos_sin: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, heads: int, kv_heads: int,
                 eps: float) -> torch.Tensor | None:
    """The q and k heads of qkv [B, T, heads + 2 kv_heads, hd], each normed by its weight ([hd]; None: no
    norm) and rotated at its position (positions [B, T] into the [max_len, hd] cos / sin tables,
    rotate-half) -> [B, heads + kv_heads, T, hd]; None where the kernel does not apply."""
    weights = [w for w in (q_weight, k_weight) if w is not None]
    if not _norms_apply(qkv, *weights, *cos_sin) or qkv.stride(-1) != 1 or qkv.shape[-1] > 1024:
        return None
    q_w, k_w = (NO_WEIGHT if w is None else w for w in (q_weight, k_weight))
    return _kernels.module.qk_norm_rope(qkv, q_w, k_w, cos_sin[0], cos_sin[1], positions.contiguous(), heads, kv_heads, eps)


def decoder_rows(tokens: torch.Tensor, embedding: torch.Tensor, weights: list[torch.Tensor], final_norm: torch.Tensor,
                 cache, cos_sin: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, tables: torch.Tensor,
                 spans: tuple[list[int], list[int]], taps: list[int], heads: int, kv_heads: int,
                 eps: float, tap_dest: torch.Tensor | None = None) -> list[torch.Tensor]:
    """A decoder's layers over rows of real tokens (tokens [B, T], T <= ATTENTION_MAX_QUERIES, B * T <= MAX_ROWS) in one
    C++ call: [final-normed hidden [B, T, H], the outputs of the layers in `taps` (ascending; tap id len(layers): the
    final-normed hidden)]. spans = (starts, lengths)
    on the host: row b's first lengths[b] tokens are real (the rest padding, computed and never stored) and their
    K/V go to positions from starts[b] through its block table (tables [B, nb], `cache.block_shift`). With `tap_dest`
    (`stores_taps`: laid out in the cache's blocks), the taps' real rows go there at the same blocks and positions
    instead, and the list is [hidden]. The same kernels and arithmetic as the
    module path, bitwise (`Decoder.forward` decides where it applies)."""
    return _kernels.module.decoder_rows(tokens, embedding, weights, final_norm, cache.k, cache.v, cos_sin[0],
                                        cos_sin[1], positions, tables, cache.block_shift, *spans, taps,
                                        NO_WEIGHT if tap_dest is None else tap_dest, heads, kv_heads,
                                        cache.k.shape[-1], eps)


def stores_taps(tap_dest: torch.Tensor | None) -> bool:
    """Whether `decoder_rows` can write tap features into tap_dest: fp32 on the CPU, contiguous."""
    return (tap_dest is not None and tap_dest.dtype == torch.float32 and tap_dest.is_cpu
            and tap_dest.is_contiguous() and tap_dest.dim() == 3)


def argmax_rows(x: torch.Tensor) -> list[int]:
    """x.argmax(-1).tolist() for x [N, V]: one C++ loop for fp32 on the CPU (torch's argmax and tolist cost a verify
    several times as much), the same indices (first among equals, NaN as the largest)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] and enabled():
        return _kernels.module.argmax_rows(x.contiguous())
    return x.argmax(dim=-1).tolist()


def _score_row(row: torch.Tensor, position: int = 0) -> bool:
    return (row.dtype in (torch.float32, torch.float64) and row.device.type == "cpu" and row.dim() == 1
            and row.numel() > 0 and position < 2**64 and enabled())


def gumbel_argmax(scores: torch.Tensor, seed: int, position: int, stream: int, offset: int = 0, divisor: float = 1.0,
                  floor: float = -math.inf) -> int | None:
    """distributions.sample's Gumbel-max of one row of scores (fp32 or fp64, over `divisor`; those below `floor` cut)
    on the CPU, in one C++ loop that draws the noise of only the tokens that could win (the same uniforms, the same
    formula); None where it does not apply (the kernels off or not built, another dtype or device)."""
    if _score_row(scores, position):
        return _kernels.module.gumbel_argmax(scores.contiguous(), divisor, floor, seed, position, stream, offset)
    return None


def residual_argmax(scores: torch.Tensor, divisor: float, floor: float, lse: float, q_ids: torch.Tensor,
                    q_probs: torch.Tensor, seed: int, position: int, stream: int, offset: int = 0) -> int | None:
    """LogProbRows.sample_residual's sample of max(0, p - q) in one C++ call; None where the kernels do not apply."""
    if _score_row(scores, position):
        return _kernels.module.residual_argmax(scores.contiguous(), divisor, floor, lse, q_ids, q_probs, seed,
                                               position, stream, offset)
    return None


def logsumexp(scores: torch.Tensor, divisor: float = 1.0, floor: float = -math.inf) -> float | None:
    """log sum exp(scores / divisor) over the scores at least `floor`, of one fp32 or fp64 row, in fp64
    (distributions.LogProbRows' normaliser); None where the kernels do not apply."""
    return _kernels.module.logsumexp_row(scores.contiguous(), divisor, floor) if _score_row(scores) else None


def warp_floor(scores: torch.Tensor, divisor: float, top_k: int, top_p: float) -> float | None:
    """The smallest score of row / divisor that top-k and top-p keep (-inf: nothing cut), found without sorting the
    row (distributions.LogProbRows); None where the kernels do not apply."""
    return _kernels.module.warp_floor(scores.contiguous(), divisor, top_k, top_p) if _score_row(scores) else None


def philox_uniform(seed: int, position: int, stream: int, index: int = 0) -> float | None:
    """distributions.uniforms(seed, position, stream, index + 1)[index] without the ones before it; None where the
    kernels are off (or the position takes the counter's fourth word)."""
    return _kernels.module.philox_uniform(seed, stream, position, index) if position < 2**64 and enabled() else None


def gumbel_rows(token_ids: torch.Tensor, seeds: Sequence[int], streams: Sequence[int],
                positions: Sequence[int]) -> torch.Tensor | None:
    """distributions.gumbel_at of many rows in one C++ loop: token_ids [N, m] (CPU int64), row n keyed by seeds[n],
    streams[n] at positions[n] -> [N, m] fp64; None where the kernels are off (or a position takes the counter's
    fourth word)."""
    if not enabled() or any(p >= 2**64 for p in positions):
        return None
    return _kernels.module.gumbel_rows(token_ids.contiguous(), list(seeds), list(streams), list(positions))
