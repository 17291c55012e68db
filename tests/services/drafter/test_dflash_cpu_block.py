"""The drafter's one-call CPU path (cpu_block.py) against the torch module it replaces at inference:
block forward, context K/V, the greedy selector walk, and whole proposals (fused and apart)."""

from __future__ import annotations

import pytest
import torch

from blockspec.common import cpu_kernels
from blockspec.common.decoder import rope_table
from blockspec.common.kv_cache import SlotKVCache
from blockspec.services.build.tiny import build_tiny_drafter
from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.drafter.dflash.cpu_block import CpuDrafter
from blockspec.services.drafter.dflash.model import DrafterContext
from blockspec.services.drafter.proposer import ProposeInput
from blockspec.services.engine import Engine

pytestmark = pytest.mark.skipif(not cpu_kernels.enabled(), reason="the CPU kernels could not be built here")


@pytest.fixture(scope="module", params=[2, None], ids=["conv", "no-conv"])
def drafter(request, tiny_models, tmp_path_factory):
    path = build_tiny_drafter(tmp_path_factory.mktemp("cpu-block") / "d", tiny_models["qwen3"]["target"],
                              num_layers=2, conv_kernel_size=request.param)
    return load_drafter(path)


def _context(model, lens, seed=0):
    """A cache holding random context K/V (through the torch module) for len(lens) requests."""
    cfg = model.cfg
    torch.manual_seed(seed)
    cache = SlotKVCache(cfg.num_layers, len(lens) + 1, cfg.num_kv_heads, 64, cfg.head_dim)
    cos, sin = rope_table(cfg, 64 + cfg.block_size)
    taps = torch.randn(sum(lens), len(cfg.target_layer_ids) * cfg.hidden_size)
    slots = [s + 1 for s in range(len(lens))]  # not slot 0: the slot index must be honoured
    return cache, cos, sin, taps, slots


def test_context_kv_matches_the_module(drafter):
    cfg, lens = drafter.cfg, [5, 0, 11]
    cache, cos, sin, taps, slots = _context(drafter, lens)
    rows = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        CpuDrafter(drafter, True).context(taps, cache, rows, positions, cos, sin)
        ref = drafter.context_kv(drafter.context(taps)[None], cos[positions][None, None], sin[positions][None, None])
    for layer, (k, v) in enumerate(ref):
        torch.testing.assert_close(cache.k[layer, rows, :, positions], k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[layer, rows, :, positions], v[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_conv", [True, False])
def test_block_matches_the_module(drafter, use_conv):
    cfg, lens = drafter.cfg, [5, 0, 11]
    cache, cos, sin, taps, slots = _context(drafter, lens)
    fast = CpuDrafter(drafter, use_conv)
    rows = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)])
    positions = torch.cat([torch.arange(n) for n in lens])
    B, R = cfg.block_size, len(lens)
    embeds = torch.randn(R, B, cfg.hidden_size)
    lens_t, slots_t = torch.tensor(lens), torch.tensor(slots)
    with torch.inference_mode():
        fast.context(taps, cache, rows, positions, cos, sin)
        got = fast.block(embeds, cache, slots_t, lens_t, cos, sin)
        key_len = max(lens)
        layer_kv = [cache.read(layer, slots_t, key_len) for layer in range(cfg.num_layers)]
        block_pos = lens_t[:, None] + torch.arange(B)
        ctx = DrafterContext(layer_kv, torch.arange(key_len)[None] < lens_t[:, None],
                             (cos[block_pos][:, None], sin[block_pos][:, None]))
        want = drafter(embeds, ctx, use_conv and cfg.conv_kernel_size is not None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_walk_matches_the_module(drafter):
    torch.manual_seed(1)
    fast, sel, V = CpuDrafter(drafter, True), drafter.candidate_selector, drafter.cfg.vocab_size
    with torch.inference_mode():
        for R in (1, 2, 4):
            hidden, logits = torch.randn(R, 5, drafter.cfg.hidden_size) * 3, torch.randn(R, 5, V) * 2
            anchor = torch.randint(0, V, (R,))
            assert torch.equal(fast.walk(hidden, logits, anchor), sel.walk(hidden, logits, anchor))


def test_proposals_equal_the_torch_path(tiny_models, dflash_drafters, prompts):
    """Whole proposals, incremental context included, on a distilled drafter: the same tokens."""
    engines = [Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=3)
               for _ in range(2)]
    assert engines[0].proposer._cpu is not None
    engines[1].proposer._cpu = None  # the torch module
    engines.append(Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=3))
    engines[2].proposer._cpu.lm_head_panels = lambda lm_head: None  # block, LM head and walk apart (a shared LM head)
    for engine in engines:
        for i, p in enumerate(prompts[:3]):
            engine.verifier.add(str(i), p)
        engine.verifier.prefill([str(i) for i in range(3)])
    for k in (1, 4, 7):
        inputs = [ProposeInput(str(i), engines[0].verifier.committed(str(i)), k) for i in range(3)]
        fused, ref, apart = ([d.token_ids for d in e.proposer.propose(inputs)] for e in engines)
        assert fused == ref == apart
    cpu_kernels.set_enabled(False)  # switched off at run time: the torch module, the same drafts
    try:
        assert [d.token_ids for d in engines[0].proposer.propose(inputs)] == fused
    finally:
        cpu_kernels.set_enabled(True)
