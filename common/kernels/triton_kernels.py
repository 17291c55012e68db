"""The Triton kernels behind `gpu_kernels`' operators on CUDA, and their launchers: products (a GEMM with tiles and split
of K fixed by the weight's shape and the device, left as split partials that the next kernel adds; the experts' grouped
GEMM), attention over the paged cache through block tables, with a key split fixed by each row's position (the per-row kernels: `triton_rows.py`; a Gated DeltaNet's:
`triton_deltanet.py`). Triton is imported on first use: the CPU path never needs it. `TRITON_INTERPRET=1` runs them on CPU tensors (tests/common/runtime/test_cuda_runner.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

CHUNK = 256  # keys per attention split at least: a row's splits are whole chunks of its keys (`attention_split`)
MAX_SPLITS = 32  # key splits a row at most, and the partials' size: longer contexts take longer splits
BLOCK_M = 64  # GEMM rows per tile, whatever the row count (a decode's 1 row is a padded tile)
ATTN_BLOCK_N = 64  # keys per attention tile

@functools.cache
def _products() -> SimpleNamespace:
    """The GEMM, the sum of its split partials, the experts' grouped GEMM."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemm(x, w, out, M, N, K, stride_xm, stride_wn, stride_sm,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr):
        # out[split, m, n] = sum over this split's K range of x[m, k] * w[n, k], in fp32, BK at a time in order; stored
        # in out's type (the output itself where K is not split).
        pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k0 = ps * K_STEPS * BK
        for step in range(K_STEPS):
            k = k0 + step * BK + rk
            a = tl.load(x + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(w + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(out + ps * stride_sm + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def sum_splits(parts, out, size, S: tl.constexpr, BLOCK: tl.constexpr):
        # out = parts[0] + parts[1] + ... in that order, cast to out's type.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < size
        total = tl.load(parts + i, mask=live, other=0.0)
        for s in range(1, S):
            total += tl.load(parts + s * size + i, mask=live, other=0.0)
        tl.store(out + i, total.to(out.dtype.element_ty), mask=live)

    @triton.jit
    def grouped_gemm(x, w, rows, block_expert, out, N, K, E, rows_per_x, stride_we, stride_wn,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_STEPS: tl.constexpr):
        # One block of BM rows of one expert (rows: the x row of each, -1 for padding), BN outputs:
        # out[r, n] = sum_k x[rows[r] // rows_per_x, k] * w[expert, n, k], BK at a time in order.
        pb, pn = tl.program_id(0), tl.program_id(1)
        e = tl.load(block_expert + pb)
        r = pb * BM + tl.arange(0, BM)
        src = tl.load(rows + r)
        live_r = (src >= 0) & (e < E)
        src_row = tl.where(src >= 0, src // rows_per_x, 0)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        we = w + tl.minimum(e, E - 1).to(tl.int64) * stride_we
        for step in range(K_STEPS):
            k = step * BK + rk
            a = tl.load(x + src_row[:, None] * K + k[None, :], mask=live_r[:, None] & (k[None, :] < K), other=0.0)
            b = tl.load(we + rn[:, None] * stride_wn + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K) & (e < E),
                        other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(out + r[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=(rn[None, :] < N))

    return SimpleNamespace(triton=triton, gemm=gemm, sum_splits=sum_splits, grouped_gemm=grouped_gemm)


@functools.cache
def _attention() -> SimpleNamespace:
    """Attention over the paged cache by key splits, and the splits' combine."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(q, kc, vc, tables, positions, m_out, l_out, acc_out, scale, T, H, KV, st_b, st_j,
               sq_b, sq_t, sq_h, sk_b, sk_h, sk_l,
               G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, CH: tl.constexpr,
               SPLITS: tl.constexpr, BN: tl.constexpr):
        # One query row (b, t), one KV head, one split: the partial softmax of the G query heads that share the KV
        # head over the split's keys up to the row's position. A row's keys [0, position] are cut into chunks of CH,
        # each split taking ceil(chunks / SPLITS) consecutive ones: a function of the row's position alone. Key j lies
        # in block tables[b, j // BS] at offset j % BS.
        row, kv, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, t = row // T, row % T
        keys = tl.load(positions + row) + 1
        span = (((keys + CH - 1) // CH + SPLITS - 1) // SPLITS) * CH  # keys per split of this row
        start = s * span
        end = tl.minimum(start + span, keys)
        tiles = (end - start + BN - 1) // BN  # none in a split past the row's keys: work follows the context
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = kv * G + g
        qv = tl.load(q + b * sq_b + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=(g[:, None] < G) & (tiles > 0),
                     other=0.0)  # an empty split reads nothing
        m = tl.full((GP,), float("-inf"), tl.float32)
        s_sum = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        table = tables + b.to(tl.int64) * st_b
        n0 = 0
        while n0 < tiles:
            n = start + n0 * BN + tl.arange(0, BN)
            live = n < end
            block = tl.load(table + (n // BS) * st_j, mask=live, other=0)
            at = block * sk_b + kv * sk_h + (n % BS) * sk_l  # int64: the block ids are
            kt = tl.load(kc + at[:, None] + d[None, :], mask=live[:, None], other=0.0)
            vt = tl.load(vc + at[:, None] + d[None, :], mask=live[:, None], other=0.0)
            scores = tl.dot(qv, tl.trans(kt)) * scale
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - 0) = 0, not NaN
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            s_sum = s_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
            n0 += 1
        o = ((row * H + heads) * SPLITS + s).to(tl.int64)  # x D passes 2^31 with many rows
        tl.store(m_out + o, m, mask=g < G)
        tl.store(l_out + o, s_sum, mask=g < G)
        tl.store(acc_out + o[:, None] * D + d[None, :], acc, mask=g[:, None] < G)

    @triton.jit
    def combine(m_in, l_in, acc_in, gate, out, n_chunks, CP: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr):
        # One (row, head): the splits' partials merged, in split order, into the output row; GATE: times
        # sigmoid(gate), each rounded to the output's dtype as torch rounds them.
        rh = tl.program_id(0)
        c = tl.arange(0, CP)
        d = tl.arange(0, D)
        live = c < n_chunks
        m = tl.load(m_in + rh * n_chunks + c, mask=live, other=float("-inf"))
        l_part = tl.load(l_in + rh * n_chunks + c, mask=live, other=0.0)
        a = tl.load(acc_in + (rh * n_chunks + c).to(tl.int64)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total = tl.sum(l_part * w, 0)
        o = (tl.sum(a * w[:, None], 0) / total).to(out.dtype.element_ty)
        if GATE:
            z = tl.load(gate + rh * D + d).to(tl.float32)
            o = (o.to(tl.float32) * (1.0 / (1.0 + tl.exp(-z))).to(out.dtype.element_ty).to(tl.float32))
        tl.store(out + rh * D + d, o.to(out.dtype.element_ty))

    return SimpleNamespace(triton=triton, attend=attend, combine=combine)


def gemm_config(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, split of K) for a weight [n, k] on a device of `sms` multiprocessors: a function of the weight
    and the device only. K is split until the tiles of one row block fill about two waves of the device, in whole
    BLOCK_K steps."""
    block_n, block_k = (64, 128) if k % 128 == 0 else (64, 32)
    tiles = -(-n // block_n)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * sms and k % (2 * split * block_k) == 0:
        split *= 2
    return block_n, block_k, split


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def triton_linear_parts(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K].T as its split partials [S, ..., N]: fp32, in the order of K; with S = 1 the product itself
    in x's dtype. Its consumer adds them (`summed`)."""
    kn = _products()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    (m, k), n = x2.shape, w.shape[0]
    block_n, block_k, split = gemm_config(n, k, _sms(x.device))
    parts = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    kn.gemm[(kn.triton.cdiv(m, BLOCK_M), kn.triton.cdiv(n, block_n), split)](
        x2, w, parts, m, n, k, x2.stride(0), w.stride(0), parts.stride(0),
        BM=BLOCK_M, BN=block_n, BK=block_k, K_STEPS=-(-k // (split * block_k)))
    return parts.view(split, *shape[:-1], n)


def triton_sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A product's split partials [S, ..., N] added in split order, in `dtype`."""
    if parts.shape[0] == 1:
        return parts[0].to(dtype)
    kn = _products()
    out = torch.empty(parts.shape[1:], dtype=dtype, device=parts.device)
    size = out.numel()
    kn.sum_splits[(kn.triton.cdiv(size, 1024),)](parts.contiguous(), out, size, S=parts.shape[0], BLOCK=1024)
    return out


def triton_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return triton_sum_parts(triton_linear_parts(x, w), x.dtype)


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                     positions: torch.Tensor, scale: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    kn = _attention()
    B, T, H, D = q.shape
    _, KV, BS, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or q.stride(-1) != 1:
        raise ValueError("cache_attention needs the caches alike and the last dimension of q and the caches dense")
    G = H // KV
    rows = B * T
    m = torch.empty((rows, H, MAX_SPLITS), dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    acc = torch.empty((rows, H, MAX_SPLITS, D), dtype=torch.float32, device=q.device)
    positions = positions.reshape(-1)
    kn.attend[(rows, KV, MAX_SPLITS)](
        q, k_cache, v_cache, tables, positions, m, s, acc, scale, T, H, KV, tables.stride(0), tables.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=G, GP=max(16, kn.triton.next_power_of_2(G)), D=D, BS=BS, CH=CHUNK, SPLITS=MAX_SPLITS, BN=ATTN_BLOCK_N)
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    kn.combine[(rows * H,)](m, s, acc, out if gate is None else gate, out, MAX_SPLITS, CP=MAX_SPLITS, D=D,
                            GATE=gate is not None)
    return out


def attention_split(position: int) -> int:
    """Keys per attention split of a query row at `position`: whole chunks of CHUNK, as few as keep the row's keys
    [0, position] within MAX_SPLITS splits. A function of the row's own position, never of the batch or max_len: a
    row's keys are split and combined in the same order in any batch, and a short context is not read in a few long
    splits. The fp32 partials take rows x heads x MAX_SPLITS x (head_dim + 2) x 4 bytes."""
    chunks = -(-(position + 1) // CHUNK)
    return -(-chunks // MAX_SPLITS) * CHUNK


MOE_BLOCK = 16  # rows of one expert per grouped-GEMM block, whatever the token count


def moe_layout(ids: torch.Tensor, experts: int,
               block: int = MOE_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, rank) pairs of ids [N, top_k] grouped by expert, each group padded to whole blocks, in a layout of
    static size (N top_k + experts (block - 1), rounded up to a block): (rows [size]: the pair index p = token top_k +
    rank at each position, -1 for padding; block_expert [size / block]: each block's expert, `experts` for an unused
    block; at [N top_k]: each pair's position). Device operations only: no count is read back."""
    pairs = ids.numel()
    flat = ids.reshape(-1)
    size = -(-(pairs + experts * (block - 1)) // block) * block
    order = torch.sort(flat, stable=True).indices  # pair indices grouped by expert, each group in pair order
    # [E]; not bincount, whose output size hangs on the largest id (a read back, which a graph capture refuses)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    start = torch.cumsum(padded, 0) - padded  # each expert's first position in the layout
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    expert_of = flat[order]
    rank = torch.arange(pairs, device=ids.device) - first[expert_of]
    rows = torch.full((size,), -1, dtype=torch.long, device=ids.device)
    rows[start[expert_of] + rank] = order
    ends = torch.cumsum(padded, 0)  # [E]: the layout position after each expert's group
    block_starts = torch.arange(0, size, block, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # E where the block is past every group
    at = torch.empty(pairs, dtype=torch.long, device=ids.device)
    at[order] = start[expert_of] + rank
    return rows, block_expert, at


def triton_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    kn = _products()
    N, H = x.shape
    E = gate_up.shape[0]
    top_k = ids.shape[1]
    rows, block_expert, at = moe_layout(ids, E)
    size = rows.shape[0]
    x = x.contiguous()

    def grouped(inp: torch.Tensor, w: torch.Tensor, rows_per_x: int, src: torch.Tensor) -> torch.Tensor:
        n_out, k = w.shape[1], w.shape[2]
        out = torch.empty((size, n_out), dtype=inp.dtype, device=inp.device)
        block_k = 128 if k % 128 == 0 else 32
        kn.grouped_gemm[(size // MOE_BLOCK, kn.triton.cdiv(n_out, 64))](
            inp, w, src, block_expert, out, n_out, k, E, rows_per_x, w.stride(0), w.stride(1),
            BM=MOE_BLOCK, BN=64, BK=block_k, K_STEPS=-(-k // block_k))
        return out

    gu = grouped(x, gate_up, top_k, rows)  # [size, 2 I]: row r is pair rows[r]'s token through its expert
    gate, up = gu.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()  # [size, I]
    positions = torch.arange(size, device=x.device)
    y = grouped(act, down, 1, torch.where(rows >= 0, positions, -1))  # [size, H]
    y = y[at].view(N, top_k, H)  # back in (token, rank) order
    out = y[:, 0] * weights[:, 0, None]
    for j in range(1, top_k):  # the ranks in order
        out = out + y[:, j] * weights[:, j, None]
    return out
