"""The drafter's one-call CPU path (cpu_block.py) against the torch module it replaces at inference:
block forward, context K/V, the greedy selector walk, and whole proposals (fused and apart, greedy and
sampling)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blockspec.common.contracts import ProposeInput
from blockspec.common.kernels import cpu_kernels
from blockspec.common.models.decoder import rope_table
from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.drafter.dflash import cpu_block
from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.drafter.dflash.cpu_block import ENV_BF16, CpuDrafter
from blockspec.services.drafter.dflash.model import DFlashDrafter, DrafterContext
from blockspec.services.engine.engine import Engine
from blockspec.services.training.tiny import build_tiny_drafter
from tests.helpers import with_sampling_top_k

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
    _block_against_the_module(drafter, use_conv)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 64), (2, 1, 32), (8, 2, 16), (2, 2, 128)])
def test_block_matches_the_module_for_other_head_layouts(drafter, heads, kv_heads, head_dim):
    """The drafter's own attention loop: a chunk of queries per KV head (more than one chunk where a KV head
    has 4 x 8 queries), head sizes of one to eight vectors."""
    torch.manual_seed(head_dim)
    cfg = dataclasses.replace(drafter.cfg, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert CpuDrafter(model, True).usable
    _block_against_the_module(model, True)


def _block_against_the_module(drafter, use_conv):
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


def test_weights_changed_in_place_are_seen(tiny_models, tmp_path):
    """A projection (held as a packed copy) and a norm weight (held as a view) modified in place after the
    first call: the next block follows the module again."""
    model = load_drafter(build_tiny_drafter(tmp_path / "d", tiny_models["qwen3"]["target"], num_layers=1))
    cfg, lens = model.cfg, [4]
    cache, cos, sin, taps, slots = _context(model, lens)
    fast = CpuDrafter(model, True)
    embeds, lens_t, slots_t = torch.randn(1, cfg.block_size, cfg.hidden_size), torch.tensor(lens), torch.tensor(slots)
    with torch.inference_mode():
        fast.context(taps, cache, torch.tensor(slots * 4), torch.arange(4), cos, sin)
        before = fast.block(embeds, cache, slots_t, lens_t, cos, sin)
    for weight in (model.layers[0].mlp.down_proj.weight, model.layers[0].post_attention_layernorm.weight):
        with torch.no_grad():
            weight.mul_(1.5)
        with torch.inference_mode():
            after = fast.block(embeds, cache, slots_t, lens_t, cos, sin)
            key_len = max(lens)
            block_pos = lens_t[:, None] + torch.arange(cfg.block_size)
            ctx = DrafterContext([cache.read(0, slots_t, key_len)], torch.arange(key_len)[None] < lens_t[:, None],
                                 (cos[block_pos][:, None], sin[block_pos][:, None]))
            want = model(embeds, ctx, True)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, want, rtol=1e-4, atol=1e-4)
        before = after


def test_greedy_walk_matches_the_module(drafter):
    torch.manual_seed(1)
    fast, sel, V = CpuDrafter(drafter, True), drafter.candidate_selector, drafter.cfg.vocab_size
    with torch.inference_mode():
        for R in (1, 2, 4):
            hidden, logits = torch.randn(R, 5, drafter.cfg.hidden_size) * 3, torch.randn(R, 5, V) * 2
            anchor = torch.randint(0, V, (R,))
            assert torch.equal(fast.walk(hidden, logits, anchor), sel.walk(hidden, logits, anchor))
        # Widths that are not whole runs of 16, and logits rising with the token id (every run of 16 beats
        # the current top-k): once its top-k is full, the C++ offers only the logits of a run of 16 that
        # beat the current last.
        hidden, anchor = torch.randn(2, 5, drafter.cfg.hidden_size), torch.randint(0, V, (2,))
        for logits in (torch.randn(2, 5, V - 5), torch.randn(2, 5, 21), torch.linspace(0, 9, V) + torch.rand(2, 5, V)):
            assert torch.equal(fast.walk(hidden, logits, anchor), sel.walk(hidden, logits, anchor))
        # Logits of three values, mostly ties: the C++ takes the lower token id first among equals (torch's
        # topk has no such rule), as the module does once a tiny margin falling with the id orders them.
        ties = torch.randint(0, 3, (2, 5, V)).float()
        assert torch.equal(fast.walk(hidden, ties, anchor), sel.walk(hidden, ties - torch.arange(V) * 1e-7, anchor))
        # A few ties near the top (logits in steps of 1/8), which the ranked top-k of the AVX-512 path places
        # (above 64 logits at or over its bound, as with the three values above, it leaves them to the offers).
        coarse = (torch.randn(2, 5, V) * 8).round() / 8
        near = coarse - torch.arange(V) * 1e-6  # each tie ordered by token id (a step over an ulp for |x| < 8)
        assert torch.equal(fast.walk(hidden, coarse, anchor), sel.walk(hidden, near, anchor))
        assert (coarse.topk(16).values[..., :-1] == coarse.topk(16).values[..., 1:]).any()  # ties among the top


def test_greedy_walk_over_a_draft_vocabulary_matches_the_module(drafter):
    """Logit columns that are a subset of the tokens (ids increasing): both walks choose what the walk over
    the whole vocabulary chooses when every other token's logit is -inf (codebooks read by token id)."""
    torch.manual_seed(2)
    fast, sel, V = CpuDrafter(drafter, True), drafter.candidate_selector, drafter.cfg.vocab_size
    ids = torch.randperm(V)[:64].sort().values
    with torch.inference_mode():
        for R in (1, 3):
            hidden, full = torch.randn(R, 5, drafter.cfg.hidden_size) * 3, torch.full((R, 5, V), -torch.inf)
            full[..., ids] = torch.randn(R, 5, 64) * 2
            anchor = torch.randint(0, V, (R,))
            want = sel.walk(hidden, full, anchor)
            assert set(want.flatten().tolist()) <= set(ids.tolist())
            assert torch.equal(fast.walk(hidden, full, anchor), want)
            assert torch.equal(fast.walk(hidden, full[..., ids], anchor, ids), want)
            assert torch.equal(sel.walk(hidden, full[..., ids], anchor, ids=ids), want)
        with pytest.raises(RuntimeError, match="one int64 token id per logit column"):
            fast.walk(hidden, full[..., ids[:32]], anchor, ids)


@pytest.mark.parametrize("name", ["qwen3-trained", "qwen3-trained-vocab"])
def test_proposals_equal_the_torch_path(tiny_models, dflash_drafters, prompts, monkeypatch, name):
    """Whole proposals, incremental context included, on a distilled drafter (with and without a draft
    vocabulary): the same tokens."""
    monkeypatch.setenv(ENV_BF16, "0")  # fp32 weights: the module's arithmetic
    engines = [Engine(tiny_models["qwen3"]["target"], dflash_drafters[name], "dflash", max_batch=3) for _ in range(2)]
    assert engines[0].proposer._cpu is not None
    engines[1].proposer._cpu = None  # the torch module
    engines.append(Engine(tiny_models["qwen3"]["target"], dflash_drafters[name], "dflash", max_batch=3))
    engines[2].proposer._cpu.lm_head_panels = lambda lm_head: None  # block, LM head and walk apart (a shared LM head)
    for engine in engines:
        for i, p in enumerate(prompts[:3]):
            engine.verifier.add(str(i), p)
        engine.verifier.prefill([str(i) for i in range(3)])
    for k in (1, 4, 7):
        inputs = [ProposeInput(str(i), engines[0].verifier.committed(str(i)), k) for i in range(3)]
        fused, ref, apart = ([d.token_ids for d in e.proposer.propose(inputs)] for e in engines)
        assert fused == ref == apart
        engines[1].proposer.cache.key_step = 8  # the context's keys read in spans, as on CUDA: the same drafts
        assert [d.token_ids for d in engines[1].proposer.propose(inputs)] == fused
        engines[1].proposer.cache.key_step = 1
        if engines[0].proposer.vocab_ids is not None:
            assert {t for row in fused for t in row} <= set(engines[0].proposer.vocab_ids.tolist())
    cpu_kernels.set_enabled(False)  # switched off at run time: the torch module, the same drafts
    try:
        assert [d.token_ids for d in engines[0].proposer.propose(inputs)] == fused
    finally:
        cpu_kernels.set_enabled(True)
    for engine in engines[:2]:  # a projection the fused path holds a packed copy of, changed in place
        with torch.no_grad():
            engine.proposer.model.layers[0].mlp.down_proj.weight.mul_(-3)
    changed = [d.token_ids for d in engines[0].proposer.propose(inputs)]
    assert changed == [d.token_ids for d in engines[1].proposer.propose(inputs)] and changed != fused


SAMPLED = [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.0, seed=2**64 - 5, rule="strict"),
           GREEDY]


@pytest.mark.parametrize("width", [None, 24], ids=["selector-width", "sampling-top-k-24"])
@pytest.mark.parametrize("name", ["qwen3-trained", "qwen3-trained-vocab"])
def test_sampled_proposals_equal_the_torch_path(tiny_models, dflash_drafters, prompts, monkeypatch, tmp_path, name,
                                                width):
    """A batch mixing rejection, strict and greedy requests: the one-call sampled walk and the C++ walk after a torch LM
    head pick the tokens the torch walk with `WalkSampler` picks (the same noise), and a rejection row's q is the
    torch path's (its candidates, and its probabilities to fp32 rounding); strict and greedy rows carry no q. With
    sampling_top_k wider than the selector's top_k, the sampling rows' q spans that many candidates and the greedy
    row drafts what it drafts alone."""
    monkeypatch.setenv(ENV_BF16, "0")  # fp32 weights: the module's arithmetic
    path = dflash_drafters[name] if width is None else with_sampling_top_k(dflash_drafters[name], width, tmp_path / "d")
    engines = [Engine(tiny_models["qwen3"]["target"], path, "dflash", max_batch=3) for _ in range(3)]
    engines[1].proposer._cpu = None  # the torch module
    engines[2].proposer._cpu.lm_head_panels = lambda lm_head: None  # block, LM head and walk apart (a shared LM head)
    narrow = None if width is None else Engine(tiny_models["qwen3"]["target"], dflash_drafters[name], "dflash",
                                               max_batch=3)
    for engine in [*engines, narrow] if narrow else engines:
        if narrow:  # a pairwise term that can lift a candidate past the unary top_k
            with torch.no_grad():
                engine.proposer.model.candidate_selector.successor_codebook.mul_(200)
        for i, p in enumerate(prompts[:3]):
            engine.verifier.add(str(i), p)
        engine.verifier.prefill([str(i) for i in range(3)])
    for k in (1, 5):
        inputs = [ProposeInput(str(i), engines[0].verifier.committed(str(i)), k, sp) for i, sp in enumerate(SAMPLED)]
        fused, ref, apart = (e.proposer.propose(inputs) for e in engines)
        assert [d.token_ids for d in fused] == [d.token_ids for d in ref] == [d.token_ids for d in apart]
        for drafts in (fused, apart):
            assert drafts[0].q is not None and drafts[1].q is None and drafts[2].q is None
            assert drafts[0].q.token_ids.shape == (k, width or engines[0].proposer.cfg.selector_top_k)
            for j in range(k):  # the same candidates (each walk's own order) and probabilities
                got, want = ({int(t): float(p) for t, p in zip(d.q.token_ids[j], d.q.probs[j])}
                             for d in (drafts[0], ref[0]))
                assert got.keys() == want.keys()
                torch.testing.assert_close(torch.tensor([got[t] for t in want]), torch.tensor(list(want.values())))
        if narrow is not None:  # the greedy row walks the selector's own top_k, as with the unwidened drafter
            assert narrow.proposer.propose(inputs)[2].token_ids == fused[2].token_ids


needs_bf16 = pytest.mark.skipif(not cpu_block._extension.get().bf16_supported(),
                                reason="this CPU has neither AVX512-BF16 nor AVX2: the drafter keeps fp32 weights")


@pytest.fixture(params=[False, True], ids=["vector", "amx"])
def amx(request):
    """The bf16 projections on vector instructions, then on AMX tiles (skipped where the CPU or the kernel has
    none); the process's setting is put back after."""
    ext = cpu_block._extension.get()
    before = ext.amx_on()
    ext.set_amx(False)
    if request.param and not ext.set_amx(True):
        pytest.skip("no AMX tiles here (an Intel CPU from Sapphire Rapids on, and a kernel that grants them)")
    yield request.param
    ext.set_amx(before)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16, 17, 40])
@pytest.mark.parametrize("features", [(192, 96), (320, 64), (256, 64), (128, 112)])
def test_bf16_projection_is_the_product_of_bf16_rounded_operands(rows, features, amx):
    """fp32 sums of bf16(x) * bf16(w): what torch gives on the rounded operands, up to summation order, on
    vectors and on AMX tiles (blocks of 16 rows; 112 inputs are not whole tiles of 32 and take the vectors;
    from 4 panels of 64 outputs on, the tiles split the panels between two threads: 320 outputs unevenly)."""
    torch.manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(*features) * 0.1)
    x = torch.randn(rows, features[1])
    ext, panels = cpu_block._extension.get(), cpu_kernels.packed((w,), "bf16")
    got = ext.linear_bf16(x, panels)
    want = x.bfloat16().float() @ w.detach().bfloat16().float().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - x @ w.detach().T).abs().max() > 1e-5  # really rounded: not the fp32 product
    if amx:  # whole tiles really ran on them: the tiles round inside a pair in another order than the vectors
        ext.set_amx(False)
        assert torch.equal(got, ext.linear_bf16(x, panels)) == (features[1] % 32 != 0)


@needs_bf16
def test_the_drafter_takes_amx_tiles_where_the_cpu_has_them(drafter, monkeypatch):
    """AMX is on by default where it can be, and BLOCKSPEC_DRAFTER_AMX=0 keeps the vector instructions."""
    ext = cpu_block._extension.get()
    before = ext.amx_on()
    try:
        has_amx = ext.set_amx(True)
        ext.set_amx(False)
        first = CpuDrafter(drafter, True, bf16=True)
        assert first.amx == has_amx == ext.amx_on()  # built with bf16 weights: the switch turned on where it can be
        assert not CpuDrafter(drafter, True, bf16=False).amx
        monkeypatch.setenv(cpu_block.ENV_AMX, "0")
        assert not CpuDrafter(drafter, True, bf16=True).amx
        assert not ext.amx_on() and not first.amx  # one switch per process: the earlier drafter follows it
    finally:
        ext.set_amx(before)


@needs_bf16
def test_bf16_drafter_stays_near_the_fp32_module(drafter, tiny_models, dflash_drafters, prompts, monkeypatch):
    """bf16 weights move the block's hidden states by bf16 rounding only, and on a distilled drafter the
    proposals are mostly the fp32 ones (they differ only where candidates nearly tie)."""
    (fp32, want), (bf16, got) = _blocks(drafter, [dict(bf16=False), dict(bf16=True)])
    assert not fp32.bf16 and bf16.bf16
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    drafts = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(ENV_BF16, flag)
        proposer, drafts[flag] = _first_drafts(tiny_models, dflash_drafters, prompts)
        assert proposer._cpu.bf16 == (flag == "1")
    same = sum(a == b for a, b in zip(drafts["0"], drafts["1"]))
    assert same >= 0.8 * len(drafts["0"])


def _blocks(drafter, variants: list[dict]) -> list[tuple[CpuDrafter, torch.Tensor]]:
    """The same context and block through CpuDrafter(drafter, True, **variant) for each variant: (it, its block)."""
    cfg, lens = drafter.cfg, [5, 0, 11]
    cache, cos, sin, taps, slots = _context(drafter, lens)
    rows = torch.tensor([s for s, n in zip(slots, lens) for _ in range(n)])
    positions = torch.cat([torch.arange(n) for n in lens])
    embeds = torch.randn(len(lens), cfg.block_size, cfg.hidden_size)
    lens_t, slots_t = torch.tensor(lens), torch.tensor(slots)
    out = []
    with torch.inference_mode():
        for variant in variants:
            fast = CpuDrafter(drafter, True, **variant)
            fast.context(taps, cache, rows, positions, cos, sin)
            out.append((fast, fast.block(embeds, cache, slots_t, lens_t, cos, sin)))
    return out


def _first_drafts(tiny_models, dflash_drafters, prompts):
    """A new engine's proposer on the distilled drafter and its drafts at k = 7 for three prefilled prompts."""
    engine = Engine(tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"], "dflash", max_batch=3)
    for i, p in enumerate(prompts[:3]):
        engine.verifier.add(str(i), p)
    engine.verifier.prefill([str(i) for i in range(3)])
    inputs = [ProposeInput(str(i), engine.verifier.committed(str(i)), 7) for i in range(3)]
    return engine.proposer, [t for d in engine.proposer.propose(inputs) for t in d.token_ids]


needs_int8 = pytest.mark.skipif(not cpu_block._extension.get().int8_supported(),
                                reason="no AMX-INT8 tiles here (an Intel CPU from Sapphire Rapids on, a kernel that "
                                       "grants them): the drafter keeps bf16 weights")


@needs_int8
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("features", [(192, 128), (320, 64), (256, 256), (128, 768)])
def test_int8_projection_is_the_product_with_int8_weights(rows, features):
    """Each output feature's weights rounded to int8 steps of max |w| / 127; x split into two int8 rows (blocks of 8
    rows per tile, the panels split between two threads from 4 on): within sx / 512 per input of the product of
    the exact x and the rounded weights, sx = max |x| / 127 of its row."""
    torch.manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(*features) * 0.1)
    x = torch.randn(rows, features[1]) * torch.rand(rows, 1) * 4
    ext, panels = cpu_block._extension.get(), cpu_kernels.packed((w,), "int8")
    assert panels.dtype == torch.int8 and panels.shape == (features[0] // 64, features[1] // 4 + 1, 64, 4)
    got = ext.linear_i8(x, panels).double()
    scale = w.detach().abs().amax(1, keepdim=True) / 127
    rounded = ((w.detach() / scale).round().clamp(-127, 127) * scale).double()
    want = x.double() @ rounded.T
    bound = (x.abs().amax(1, keepdim=True).double() / 127 / 512) @ rounded.abs().sum(1)[None]
    assert ((got - want).abs() <= bound + 1e-5 * want.abs() + 1e-6).all()
    assert (got - x.double() @ w.detach().double().T).abs().max() > 1e-4  # really rounded: not the fp32 product


@needs_int8
def test_int8_drafter_stays_near_the_fp32_module(drafter, tiny_models, dflash_drafters, prompts, monkeypatch):
    """int8 weights (where AMX runs the projections; BLOCKSPEC_DRAFTER_INT8=0 keeps bf16) move the block's hidden
    states by the weights' rounding, and on a distilled drafter the proposals are mostly the fp32 ones."""
    ext = cpu_block._extension.get()
    before = ext.amx_on()
    try:
        _int8_against_fp32(drafter, tiny_models, dflash_drafters, prompts, monkeypatch)
    finally:
        ext.set_amx(before)


def _int8_against_fp32(drafter, tiny_models, dflash_drafters, prompts, monkeypatch):
    (fp32, want), (int8, got) = _blocks(drafter, [dict(bf16=False, int8=False), dict(bf16=True, int8=True)])
    assert (fp32.weights, int8.weights) == ("fp32 weights", "int8 weights on AMX tiles")
    # The projections over whole tiles of 64 inputs (the others, if any, bf16).
    assert torch.int8 in {w.dtype for w in int8._prepare()[0] if w.dim() == 4}
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    drafts = {}
    for form, (bf16, int8) in {"fp32": ("0", "1"), "bf16": ("1", "0"), "int8": ("1", "1")}.items():
        monkeypatch.setenv(ENV_BF16, bf16)
        monkeypatch.setenv(cpu_block.ENV_INT8, int8)
        proposer, drafts[form] = _first_drafts(tiny_models, dflash_drafters, prompts)
        assert proposer._cpu.int8 == (form == "int8")
        assert proposer.kernel == f"C++ ({form} weights{' on AMX tiles' if form != 'fp32' else ''})"
    same = sum(a == b for a, b in zip(drafts["fp32"], drafts["int8"]))
    assert same >= 0.8 * len(drafts["fp32"])
    monkeypatch.setenv(cpu_block.ENV_AMX, "0")  # the vector instructions have no int8 kernel: bf16
    assert not CpuDrafter(drafter, True, bf16=True, int8=True).int8
