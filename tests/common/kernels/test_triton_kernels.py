"""Every Triton kernel compiles for Hopper (sm_90, to a cubin through Triton's own ptxas) with the arguments its launcher
passes at the published shapes: a 27B dense target (head_dim 128) and Qwen3.5-27B (gated attention of head_dim 256,
partial rotary, Gated DeltaNet with 16 key and 48 value heads), bf16, at a decode and a verify of 16. No GPU is
needed: the launchers run with kernel launches recorded instead of made, and each recorded launch is compiled ahead of
time. A kernel that Triton's interpreter runs but its compiler refuses (a type changed in a loop, a runtime bound it
cannot take) fails here. The values are checked in the interpreter (tests/common/runtime/test_cuda_runner.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton: the test extra has it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from blockspec.common.kernels import triton_deltanet as td  # noqa: E402
from blockspec.common.kernels import triton_kernels as tk  # noqa: E402
from blockspec.common.kernels import triton_rows as tr  # noqa: E402

BF16 = torch.bfloat16
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32",
         torch.bool: "i1"}


def launches_at_published_shapes(rows: int) -> list[tuple[JITFunction, tuple, dict]]:
    """Each launcher of the step at the published shapes, B = 1 request of `rows` tokens; the launches recorded."""
    recorded = []

    def record(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        T, hidden = rows, 5120
        pos = torch.zeros(1, T, dtype=torch.long)
        slots = torch.zeros(1, dtype=torch.long)
        h = torch.empty(1, T, hidden, dtype=BF16)
        for n, k in ((7168, 5120), (5120, 5120), (43008, 5120), (5120, 21504), (151936, 5120)):
            tk.triton_linear(torch.empty(1, T, k, dtype=BF16), torch.empty(n, k, dtype=BF16))
        for heads, kv, d, rot, gated, zc in ((40, 8, 128, 128, False, False), (24, 4, 256, 64, True, True)):
            cols = heads * d * (2 if gated else 1) + 2 * kv * d
            parts = tk.triton_linear_parts(h, torch.empty(cols, hidden, dtype=BF16))
            cache = torch.empty(3 * 256, kv, 16, d, dtype=BF16)  # blocks of 16 positions
            tables = torch.zeros(4, 256, dtype=torch.long).t()  # as a bucket's: [batch, max_blocks], column-major
            cos = torch.empty(4096, rot, dtype=BF16)
            q, gate = tr.triton_attention_inputs(parts, None, torch.empty(d, dtype=BF16), torch.empty(d, dtype=BF16),
                                                 cos, cos, pos, pos, cache, cache, heads, kv, 1e-6, zc, gated)
            tk.triton_attention(q, cache, cache, tables[:1], pos, 0.1, gate if gated else None)
            tr.triton_add_rms_norm(tk.triton_linear_parts(q.flatten(2), torch.empty(hidden, heads * d, dtype=BF16)),
                                   None, h, torch.empty(hidden, dtype=BF16), 1e-6, zc)
        tr.triton_silu_mul(tk.triton_linear_parts(h, torch.empty(2 * 17408, hidden, dtype=BF16)), None, BF16)
        hk, hv, dk = 16, 48, 128
        C = 2 * hk * dk + hv * dk
        parts = tk.triton_linear_parts(h, torch.empty(C + hv * dk + 2 * hv, hidden, dtype=BF16))
        conv_state = torch.empty(3, 2, C, 3, dtype=BF16)
        real = torch.ones(1, T, dtype=torch.long)
        both = td.triton_causal_conv(parts, conv_state, slots, slots, real, torch.empty(C, 4), BF16)
        gates = td.triton_delta_gates(parts, C + hv * dk, C + hv * dk + hv, torch.empty(hv), torch.empty(hv), real,
                                      BF16)
        rec = torch.empty(3, 2, hv, dk, dk)
        out = td.triton_gated_delta_rule(rec, slots, slots, both, gates, hk, dk ** -0.5)
        tr.triton_gated_rms_norm(out, parts, C, torch.empty(dk), 1e-6, BF16)
        td.triton_rollback(torch.empty(2, 3, 2, hv, dk, dk), torch.empty(2, 3, 2, C, 3, dtype=BF16),
                           torch.empty(2, 3, 16, 2, C, dtype=BF16), torch.empty(2, 3, 16, 2, hv), slots, slots, slots,
                           hk)
        x, weights, ids = torch.empty(T, 2048, dtype=BF16), torch.empty(T, 8, dtype=BF16), torch.zeros(T, 8).long()
        tk.triton_moe(x, weights, ids, torch.empty(128, 1536, 2048, dtype=BF16), torch.empty(128, 2048, 768, dtype=BF16))
    finally:
        JITFunction.run = original
    return recorded


def signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    bound = dict(zip(fn.arg_names, args)) | kwargs
    sig, constexprs = {}, {}
    for p in fn.params:
        value = bound[p.name]
        if p.is_constexpr:
            sig[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[p.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[p.name] = "i1"
        elif isinstance(value, int):
            sig[p.name] = "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
        else:
            sig[p.name] = "fp32"
    return sig, constexprs


@pytest.mark.parametrize("rows", [1, 16])
def test_every_kernel_compiles_for_hopper_at_the_published_shapes(rows):
    recorded = launches_at_published_shapes(rows)
    names = {fn.fn.__name__ for fn, _, _ in recorded}
    assert names == {"gemm", "sum_splits", "norm_rope", "attend", "combine", "add_norm", "silu_mul", "conv", "gates",
                     "delta_rule", "gated_norm", "rollback", "grouped_gemm"}
    compiled = set()
    for fn, args, kwargs in recorded:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
        sig, constexprs = signature(fn, args, kwargs)
        key = (fn.fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())),
               tuple(sorted(options.items())))
        if key in compiled:
            continue
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.asm["cubin"], key[0]
        compiled.add(key)
