"""The CPU kernels: the small-batch linear (same results as torch's linear, one row independent of the batch),
the norms, attention and the row argmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockspec.common.kernels import cpu_kernels
from blockspec.common.kernels.cpu_kernels import Linear, fused_linear, linear
from blockspec.common.models.decoder import rms_norm

pytestmark = pytest.mark.skipif(not cpu_kernels.enabled(), reason="the kernel could not be built here")


def param(*shape: int, generator: torch.Generator | None = None) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape, generator=generator), requires_grad=False)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 9, 16, 17, 50, 256])
@pytest.mark.parametrize("shape", [(64, 32), (256, 256), (768, 256), (256, 768), (4096, 256)])
def test_matches_torch_linear(rows, shape):
    g = torch.Generator().manual_seed(rows)
    w = param(*shape, generator=g)
    x = torch.randn(rows, shape[1], generator=g)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_a_row_does_not_depend_on_its_batch():
    """Nor on the tile that computes it: whole panels up to 15 rows, half panels of 9-12 rows from 16 on."""
    w = param(512, 256)
    x = torch.randn(100, 256)
    with torch.inference_mode():
        full = linear(x, w)
        for n in (1, 4, 6, 7, 13, 16, 17, 23, 25, 37, 50):
            assert torch.equal(linear(x[:n], w), full[:n])
        assert torch.equal(linear(x[5:6], w), full[5:6])
        assert torch.equal(linear(x[60:100], w), full[60:100])


def test_fused_projections_equal_each_projection_alone():
    layers = [Linear(256, n, bias=bias) for n, bias in ((256, True), (128, False), (128, True))]
    x = torch.randn(1, 6, 256)
    with torch.inference_mode():
        fused = fused_linear(x, layers)
        alone = torch.cat([layer(x) for layer in layers], dim=-1)
    assert torch.equal(fused, alone)


def test_falls_back_to_torch_where_it_does_not_apply():
    w = param(256, 256)
    with torch.inference_mode():
        many = torch.randn(cpu_kernels.MAX_ROWS + 1, 256)
        assert torch.equal(linear(many, w), F.linear(many, w))  # beyond the measured range: torch's linear
        odd = param(40, 256)  # 40 output features: not whole panels of 64
        x = torch.randn(2, 256)
        assert torch.equal(linear(x, odd), F.linear(x, odd))
        cpu_kernels.set_enabled(False)
        try:
            assert torch.equal(linear(x, w), F.linear(x, w))
        finally:
            cpu_kernels.set_enabled(True)


def test_a_tensor_that_is_not_a_parameter_is_never_copied(monkeypatch):
    shared = torch.randn(128, 64)  # e.g. the target's LM head mapped from another process
    monkeypatch.setattr(cpu_kernels, "_pack", lambda w: pytest.fail("packed a shared tensor"))
    with torch.inference_mode():
        x = torch.randn(2, 64)
        assert torch.equal(linear(x, shared), F.linear(x, shared))


def test_past_the_budget_torch_linear_is_used(monkeypatch):
    monkeypatch.setitem(cpu_kernels._budget, "left", 1000)
    w, x = param(256, 256), torch.randn(1, 256)
    with torch.inference_mode():
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert cpu_kernels._budget["left"] == 1000


def test_training_keeps_autograd():
    layer = Linear(256, 64)
    x = torch.randn(3, 256, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_an_in_place_weight_update_is_seen():
    w = param(64, 64)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        before = linear(x, w)
    with torch.no_grad():
        w.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, w), 2 * before)


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_fp32_rms_norm_is_the_transformers_arithmetic():
    x, weight = torch.randn(3, 5, 256), torch.randn(256)
    with torch.inference_mode():
        fast = rms_norm(x, weight, 1e-6)  # the C++ kernel: the sum of squares in another order
        cpu_kernels.set_enabled(False)
        try:
            assert torch.equal(rms_norm(x, weight, 1e-6), transformers_rms_norm(x, weight))  # torch's: the same bits
        finally:
            cpu_kernels.set_enabled(True)
    torch.testing.assert_close(fast, transformers_rms_norm(x, weight), rtol=4e-6, atol=4e-6)
    assert not torch.equal(fast, F.rms_norm(x, (256,), None, 1e-6))  # the weight was applied


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("batch, queries", [(1, 1), (1, 8), (3, 5)])
def test_qk_norm_rope_matches_the_torch_path(qk_norm, batch, queries):
    from types import SimpleNamespace

    from blockspec.common.models.decoder import apply_rope, rope_table

    heads, kv_heads, hd = 4, 2, 64
    cos, sin = rope_table(SimpleNamespace(rope_dim=hd, rope_theta=1e4, rope_scaling=()), 64)
    qkv = torch.randn(batch, queries, heads + 2 * kv_heads, hd)
    positions = torch.randint(0, 64 - queries, (batch, 1)) + torch.arange(queries)
    q_w, k_w = (torch.randn(hd), torch.randn(hd)) if qk_norm else (None, None)
    with torch.inference_mode():
        got = cpu_kernels.qk_norm_rope(qkv, q_w, k_w, (cos, sin), positions, heads, kv_heads, 1e-6)
        qk = qkv[:, :, : heads + kv_heads]
        if qk_norm:
            qk = transformers_rms_norm(qk, torch.cat([q_w.expand(heads, -1), k_w.expand(kv_heads, -1)]))
        want = apply_rope(qk.transpose(1, 2), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (batch, heads + kv_heads, queries, hd)


def test_qk_norm_rope_refuses_what_it_cannot_do():
    qkv, cos_sin = torch.randn(1, 2, 8, 64), (torch.randn(16, 64), torch.randn(16, 64))
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="position 16 outside the table"):
            cpu_kernels.qk_norm_rope(qkv, None, None, cos_sin, torch.tensor([[15, 16]]), 4, 2, 1e-6)
        bf16 = torch.randn(64).to(torch.bfloat16)
        assert cpu_kernels.qk_norm_rope(qkv, bf16, bf16, cos_sin, torch.tensor([[0, 1]]), 4, 2, 1e-6) is None
        assert cpu_kernels.qk_norm_rope(qkv.to(torch.bfloat16), None, None, cos_sin, torch.tensor([[0, 1]]), 4, 2, 1e-6) is None


def test_norm_kernels_leave_training_to_torch():
    weight = torch.nn.Parameter(torch.randn(256))
    x = torch.randn(2, 256, requires_grad=True)
    assert cpu_kernels.rms_norm(x, weight, 1e-6) is None
    rms_norm(x, weight, 1e-6).sum().backward()
    assert weight.grad is not None and x.grad is not None
    with torch.inference_mode():
        assert cpu_kernels.rms_norm(x.detach(), weight, 1e-6) is not None
        assert cpu_kernels.rms_norm(torch.randn(2, 24), torch.randn(24), 1e-6) is None  # rows not a multiple of 16


def test_argmax_rows_equals_torch_argmax():
    torch.manual_seed(0)
    x = torch.randn(9, 4096)
    x[1, 7] = x[1, 3000] = 50.0  # ties: the first index
    x[2, :] = 1.0
    x[3, 10], x[3, 20] = float("nan"), float("nan")  # NaN counts as the largest: the first NaN
    x[4, 4095] = float("inf")
    x[5, :] = -0.0
    x[5, 9] = 0.0  # -0.0 == 0.0: the first
    x[6, :] = float("-inf")
    x[6, 100] = -1e30
    assert cpu_kernels.argmax_rows(x) == x.argmax(dim=-1).tolist()
    for width in (1, 7, 37):  # rows shorter than a vector, and a remainder after the vectors
        assert cpu_kernels.argmax_rows(x[:, :width].contiguous()) == x[:, :width].argmax(dim=-1).tolist()
    assert cpu_kernels.argmax_rows(x[:, ::2]) == x[:, ::2].argmax(dim=-1).tolist()  # not contiguous


@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 64), (8, 1, 128), (2, 2, 16), (2, 1, 256)])
@pytest.mark.parametrize("batch,queries", [(1, 1), (1, 8), (3, 5), (2, 17)])
def test_cached_attention_matches_sdpa_with_the_causal_mask(heads, kv_heads, hd, batch, queries):
    g = torch.Generator().manual_seed(batch * 100 + queries)
    slots_total, max_len = 5, 300
    kc, vc = torch.randn(slots_total, kv_heads, max_len, hd, generator=g), torch.randn(slots_total, kv_heads, max_len, hd, generator=g)
    slots = torch.tensor([4, 0, 2][:batch])
    positions = (torch.tensor([100, 0, 280][:batch])[:, None] + torch.arange(queries)).clamp(max=max_len - 1)
    q = torch.randn(batch, heads, queries, hd, generator=g) * 3
    out = cpu_kernels.cached_attention(q, kc, vc, slots[:, None], positions, 40)  # a slot cache: a block a slot
    mask = (torch.arange(max_len)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    ref = F.scaled_dot_product_attention(q, kc[slots], vc[slots], attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(batch, queries, -1), rtol=1e-5, atol=1e-5)
    # A query's result does not depend on the others computed with it.
    alone = cpu_kernels.cached_attention(q[-1:, :, -1:], kc, vc, slots[-1:, None], positions[-1:, -1:], 40)
    assert torch.equal(alone[0, 0], out[-1, -1])
    # The same keys in blocks of 16 positions, scattered over a pool in random order: the same bits.
    bs = 16
    nb = -(-max_len // bs)
    order = torch.randperm(batch * nb, generator=g)
    paged_k, paged_v = torch.zeros(batch * nb, kv_heads, bs, hd), torch.zeros(batch * nb, kv_heads, bs, hd)
    tables = order.view(batch, nb)
    for b in range(batch):
        for j in range(nb):
            keys = slice(j * bs, min((j + 1) * bs, max_len))
            n = keys.stop - keys.start
            paged_k[tables[b, j], :, :n] = kc[slots[b], :, keys]
            paged_v[tables[b, j], :, :n] = vc[slots[b], :, keys]
    assert torch.equal(cpu_kernels.cached_attention(q, paged_k, paged_v, tables.contiguous(), positions, 4), out)


@torch.no_grad()
def test_cached_attention_applies_to_short_fp32_cpu_queries_only():
    cache = torch.zeros(2, 3, 2, 64, 64)
    assert cpu_kernels.attends_in_place(cache, 1) and cpu_kernels.attends_in_place(cache, cpu_kernels.ATTENTION_MAX_QUERIES)
    assert not cpu_kernels.attends_in_place(cache, cpu_kernels.ATTENTION_MAX_QUERIES + 1)  # prefill chunks: SDPA
    assert not cpu_kernels.attends_in_place(cache.bfloat16(), 1)
    with torch.enable_grad():
        assert not cpu_kernels.attends_in_place(cache, 1)  # no autograd through the kernel
    assert not cpu_kernels.attends_in_place(torch.zeros(2, 3, 2, 64, 80), 1)  # head_dim not one the kernel has
    cpu_kernels.set_enabled(False)
    try:
        assert not cpu_kernels.attends_in_place(cache, 1)
    finally:
        cpu_kernels.set_enabled(True)


@pytest.mark.parametrize("rows, width", [(1, 768), (6, 768), (50, 768), (43, 768), (3, 64), (2, 48), (5, 40)])
def test_silu_mul_is_bitwise_silu_times_up(rows, width):
    """One pass with torch's exp where the width is whole vectors (torch computes those rows in vectors), the two
    torch operations elsewhere; infinities and large inputs included."""
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(width)) * 6
    gate_up[0, :4] = torch.tensor([float("inf"), -float("inf"), 100.0, -100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        expected = F.silu(gate) * up  # silu(-inf) is NaN in both
        torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), expected, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(cpu_kernels.silu_mul(gate_up[None]), expected[None], rtol=0, atol=0, equal_nan=True)
