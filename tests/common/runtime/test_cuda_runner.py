"""The CUDA backend (common/runtime/cuda_runner.py) where the CPU can check it: the captured step's arithmetic against
transformers, greedy streams through it equal to the target alone, bucket selection and the spare slot, the step
compiling as one graph, and the batch-invariant Triton kernels in Triton's interpreter. Capture itself needs CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.models.kv_cache import slot_rows
from blockspec.common.runtime.backends import make_runner
from blockspec.common.runtime.cuda_runner import WIDTHS, CudaRunner, batch_sizes, bucket
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent
from blockspec.services.training.tiny import build_tiny_checkpoint, build_tiny_family

VARIANTS = [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("qwen3", {"tie_word_embeddings": True})]


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("cuda-runner")
    return [build_tiny_checkpoint(root / f"{fam}-{i}", fam, seed=i, tokenizer=tokenizer, **extra)
            for i, (fam, extra) in enumerate(VARIANTS)]


def cpu_runner(path: Path, num_slots: int = 3, max_len: int = 256, tap_layers=()) -> CudaRunner:
    return CudaRunner(load_checkpoint(path), num_slots, max_len, tap_layers, torch.float32, "cpu")


def ragged_logits(runner: CudaRunner, ids: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """Three rows of ids [3, 40] run as ragged batched forwards - prefill chunks (eager), decodes and verifies
    (bucketed): the rows' slots, and each row's logits [40, vocab] put together. Each greedy decision is the argmax of
    its rows."""
    slots = [runner.cache.allocate() for _ in range(3)]
    cuts = [(0, 17, 23, 40), (0, 1, 6, 40), (0, 30, 31, 40)]
    got = [[] for _ in range(3)]
    for step in range(3):
        out = runner.forward([Segment(slots[b], ids[b, cuts[b][step] : cuts[b][step + 1]].tolist()) for b in range(3)],
                             runner.tap_buffer)
        for b, logits in enumerate(out.logits):
            got[b].append(logits)
            assert out.greedy[b][1] == logits.argmax(-1).tolist()
    return slots, [torch.cat(g) for g in got]


@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=[f"{f}{'-tied' if e else ''}" for f, e in VARIANTS])
def test_logits_and_taps_match_transformers(index, variant_dirs):
    """Ragged prefill chunks (eager), decodes and verifies (bucketed) in batched calls: logits and tap features equal
    transformers' to fp32 rounding, and the greedy decision is the argmax of the returned rows."""
    from transformers import AutoModelForCausalLM

    path = variant_dirs[index]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = cpu_runner(path, tap_layers=(0, 1))
    ids = torch.randint(0, hf.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(index))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    slots, got = ragged_logits(runner, ids)
    assert list(runner._buckets) == [(3, 8)]  # step 2 bucketed (uncaptured on the CPU)
    assert max(float((got[b] - ref.logits[b]).abs().max()) for b in range(3)) < 1e-4
    hidden = hf.config.hidden_size
    rows = slot_rows(runner.tap_buffer, runner.cache.table)  # the taps lie in the KV cache's blocks
    for layer in range(min(2, hf.config.num_hidden_layers - 1)):  # hidden_states[i + 1]: layer i's output (not the last)
        taps = torch.stack([rows[s][:40] for s in slots])[..., layer * hidden : (layer + 1) * hidden]
        assert float((taps - ref.hidden_states[layer + 1]).abs().max()) < 1e-5


def test_greedy_decision_counts_accepted_drafts(variant_dirs):
    """The decision made on the device: the drafts a greedy verify keeps stop at the first that differs from the
    target's argmax, whatever follows."""
    runner = cpu_runner(variant_dirs[2], num_slots=1)
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, list(range(5, 25)), last_only=True)])
    start = runner.cache.lengths[slot]
    chain = [7]  # the anchor, then the target's own tokens after it, one decode at a time
    for _ in range(4):
        chain.append(runner.forward([Segment(slot, chain[-1:])]).greedy[0][1][-1])
    for agree in range(4):
        runner.cache.set_length(slot, start)
        drafts = chain[1 : 1 + agree] + [(chain[1 + agree] + 1) % 300] + chain[2 + agree : 4]
        accepted, ids = runner.forward([Segment(slot, [7, *drafts[:3]])]).greedy[0]
        assert accepted == min(agree, 3) and ids[: accepted + 1] == chain[1 : accepted + 2]
    runner.cache.set_length(slot, start)
    assert runner.forward([Segment(slot, chain[:4])]).greedy[0] == (3, chain[1:5])


@pytest.mark.parametrize("method,k", [("dflash", 3), ("dflash", 7), ("draft_model", 1), ("draft_model", 5)])
def test_streams_equal_the_target_alone(method, k, tiny_models, dflash_drafters, prompts, references):
    """Speculative decoding through the CUDA runner's step (batched, ragged, chunked prefill) equals transformers
    greedy decoding of the target alone."""
    drafter = dflash_drafters["qwen3-random"] if method == "dflash" else tiny_models["qwen3"]["other"]
    engine = Engine(tiny_models["qwen3"]["target"], drafter, method, max_batch=len(prompts), backend="graphs",
                    prefill_chunk=64)
    assert isinstance(engine.verifier.runner, CudaRunner)
    engine.verifier.runner.graphs.emulate = True  # each bucket computes from the tensors of its first call, as a graph
    requests = [engine.request(f"r{i}", p, 128, k) for i, p in enumerate(prompts)]
    done = {e.request_id: e for e in engine.generate(requests) if isinstance(e, FinishEvent)}
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == references["qwen3"]


def test_buckets_and_the_spare_block(variant_dirs):
    assert batch_sizes(1) == (1,) and batch_sizes(6) == (1, 2, 4, 6) and batch_sizes(16) == (1, 2, 4, 8, 16)
    assert bucket(3, WIDTHS) == 4 and bucket(16, WIDTHS) == 16 and bucket(17, WIDTHS) is None
    runner = cpu_runner(variant_dirs[2], num_slots=6, max_len=64)
    assert runner.bucket_of(1, 1) == (1, 1) and runner.bucket_of(3, 6) == (4, 8) and runner.bucket_of(7, 2) is None
    cache = runner.cache
    assert cache.num_slots == 6 and cache.num_blocks == 6 * 4 and cache.k.shape[1] == 25  # block 24 is the spare
    a, b = cache.allocate(), cache.allocate()
    runner.forward([Segment(a, [1, 2, 3]), Segment(b, [4])])  # bucket (2, 4): padding rows write the spare block
    written = {cache.held[a][0], cache.held[b][0], cache.spare_block}
    assert not cache.k[:, [i for i in range(25) if i not in written]].any()
    assert cache.k[:, cache.spare_block].any()
    assert cache.lengths[a] == 3 and cache.lengths[b] == 1
    assert not cache.k[:, cache.held[b][0], :, 1:].any()  # b wrote its one real position only


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_scattered_blocks_give_the_eager_runners_logits(family, variant_dirs, tmp_path, tokenizer):
    """Requests whose blocks lie out of order and interleaved (other requests took and gave back blocks first, and
    they grow side by side), through prefill chunks (eager), verifies and decodes (bucketed, replayed as graphs): the
    logits and the tap features equal the eager runner's over the same forwards."""
    path = variant_dirs[2] if family == "qwen3" else build_tiny_family(tmp_path / family, family, tokenizer=tokenizer)
    ck = load_checkpoint(path)
    runner = CudaRunner(ck, 3, 128, (0, 1), torch.float32, "cpu")
    runner.graphs.emulate = True
    eager = Runner(ck, 3, 128, None, (0, 1), torch.float32, "cpu")
    cache = runner.cache
    first = [cache.allocate() for _ in range(3)]
    for slot, end in zip(first, (48, 16, 32)):
        cache.reserve(slot, end)
    cache.release(first[0])
    cache.release(first[2])
    ids = torch.randint(0, ck.config.vocab_size, (3, 44), generator=torch.Generator().manual_seed(3))
    cuts = [(0, 17, 23, 40, 41, 42, 43, 44), (0, 1, 6, 40, 41, 42, 43, 44), (0, 30, 31, 40, 41, 42, 43, 44)]
    outs = []
    for r in (runner, eager):
        if r is runner:
            slots = [cache.allocate(), cache.allocate(), first[1]]  # first[1] keeps its block: its prompt starts there
            cache.set_length(first[1], 0)
        else:
            slots = [r.cache.allocate() for _ in range(3)]
        taps = r.make_tap_buffer()
        got = [[] for _ in range(3)]
        for step in range(len(cuts[0]) - 1):
            out = r.forward([Segment(slots[b], ids[b, cuts[b][step] : cuts[b][step + 1]].tolist()) for b in range(3)],
                            taps)
            for b, logits in enumerate(out.logits):
                got[b].append(logits.clone())  # a replay's outputs are the next replay's
        rows = slot_rows(taps, r.cache.table)
        outs.append(([torch.cat(g) for g in got], [rows[s][:44] for s in slots]))
        if r is runner:
            held = [cache.held[s] for s in slots]
            assert any(h != list(range(h[0], h[0] + len(h))) for h in held), held  # not one run of blocks each
            assert sorted(sum(held, [])) != sum(held, [])  # interleaved
    (got, taps), (want, want_taps) = outs
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) < 1e-4
    assert max(float((g - w).abs().max()) for g, w in zip(taps, want_taps)) < 1e-4
    assert sorted(runner.graphs.keys()) == [(3, 1), (3, 8)]


def test_make_runner_picks_the_backend(variant_dirs, tmp_path):
    ck = load_checkpoint(variant_dirs[2])
    assert type(make_runner(ck, 1, 64)) is Runner  # auto on the CPU
    assert type(make_runner(ck, 1, 64, backend="graphs")) is CudaRunner
    hybrid = load_checkpoint(build_tiny_family(tmp_path / "hybrid", "qwen3_5"))
    assert type(make_runner(hybrid, 1, 64, backend="graphs")) is CudaRunner
    with pytest.raises(ValueError, match="backend 'fast'"):
        make_runner(ck, 1, 64, backend="fast")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe"])
def test_the_step_compiles_as_one_graph(family, variant_dirs, tmp_path, tokenizer):
    """torch.compile(fullgraph=True) of the step that CUDA captures, for each kind of layer: a graph break fails, and
    the compiled step computes what the eager one does. On fake tensors (no values) a value read back or an output
    whose shape hangs on data would raise."""
    path = variant_dirs[2] if family == "qwen3" else build_tiny_family(tmp_path / family, family, tokenizer=tokenizer)
    runner = CudaRunner(load_checkpoint(path), 2, 64, (0, 1), torch.float32, "cpu", warm_up=False)
    bucket_ = runner._bucket((2, 4))
    torch._dynamo.reset()
    compiled = torch.compile(runner.step, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.inference_mode():
        logits, decided = compiled(*bucket_.args())
        ref_logits, ref_decided = runner.step(*bucket_.args())
    assert torch.equal(logits, ref_logits) and torch.equal(decided, ref_decided)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.inference_mode(), FakeTensorMode(allow_non_fake_inputs=True):  # no values: a read back would raise
        assert runner.step(*bucket_.args())[0].shape == logits.shape


def test_the_expert_layout_reads_nothing_back():
    """What the MoE kernel builds on the device before its products, run on fake tensors (which have no values): an
    operation whose output shape hangs on the data (bincount, nonzero: a read back that a graph capture refuses)
    would raise. The layout itself: each pair once, where `at` says, each expert's group in whole blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from blockspec.common.kernels import triton_kernels as tk

    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(5)])
    with FakeTensorMode() as mode:
        assert [t.shape for t in tk.moe_layout(mode.from_tensor(ids), 8)] == [(144,), (9,), (10,)]
    rows, block_expert, at = tk.moe_layout(ids, 8)
    assert torch.equal(rows[at], torch.arange(10)) and (rows >= 0).sum() == 10  # 10 pairs, 8 x 15 padding at most
    assert (block_expert[:-1] <= block_expert[1:]).all()
    for b, e in enumerate(block_expert.tolist()):
        assert all(ids.reshape(-1)[p] == e for p in rows[16 * b : 16 * (b + 1)].tolist() if p >= 0)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from blockspec.common.kernels import gpu_kernels as gk
    from blockspec.common.kernels import references as kr
    from blockspec.common.kernels import triton_deltanet as td
    from blockspec.common.kernels import triton_kernels as tk
    from blockspec.common.kernels import triton_rows as tr

    torch.manual_seed(0)
    close = lambda a, b, tol=1e-5: (a - b).abs().max() < tol
    # GEMM: its split partials (two here) add up to the product; a row alone equal bit for bit to the same row among 13
    for n, k, splits in ((96, 256, 2), (64, 1024, 8)):
        x, w = torch.randn(13, k), torch.randn(n, k)
        parts = tk.triton_linear_parts(x, w)
        assert parts.shape == (splits, 13, n) and close(kr.sum_parts(parts, x.dtype), x @ w.T, 1e-3), "gemm"
        assert torch.equal(tk.triton_linear_parts(x[5:6], w)[:, 0], parts[:, 5]), "gemm rows"
        assert torch.equal(tk.triton_linear(x, w), kr.sum_parts(parts, x.dtype)), "gemm sum"
    # attention through block tables (blocks of 16, out of order), queries at ragged positions across splits, with and
    # without the output gate; a row alone equal bit for bit to the same row in the batch, and to the same row whose
    # blocks lie elsewhere
    kc, vc = torch.randn(40, 2, 16, 16), torch.randn(40, 2, 16, 16)
    q, gate = torch.randn(2, 3, 6, 16), torch.randn(2, 3, 6, 16)
    tables, pos = torch.stack([torch.randperm(40)[:32] for _ in range(2)]), torch.tensor([[5, 6, 7], [300, 301, 302]])
    for z in (None, gate):
        o = tk.triton_attention(q, kc, vc, tables, pos, 0.25, z)
        assert close(o, kr.attention_reference(q, kc, vc, tables, pos, 0.25, z)), "attention"
        alone = tk.triton_attention(q[1:, 1:2].contiguous(), kc, vc, tables[1:], pos[1:, 1:2].contiguous(), 0.25,
                                    None if z is None else z[1:, 1:2].contiguous())
        assert torch.equal(alone[0, 0], o[1, 1]), "attention rows"
    moved = torch.randperm(40)  # block i's contents to block moved[i]
    kc2, vc2 = torch.empty_like(kc), torch.empty_like(vc)
    kc2[moved], vc2[moved] = kc, vc
    assert torch.equal(tk.triton_attention(q, kc2, vc2, moved[tables], pos, 0.25, gate), o), "wherever the blocks lie"
    by_column = tables.t().contiguous().t()  # a bucket's tables are laid out so
    assert torch.equal(tk.triton_attention(q, kc, vc, by_column, pos, 0.25, gate), o), "tables by column"
    # a long context: longer key splits (17 of 512 keys at position 8703), the same softmax; the partials' size does
    # not depend on the context
    assert tk.attention_split(8191) == tk.CHUNK and tk.attention_split(8192) == 2 * tk.CHUNK
    kc, vc = torch.randn(140, 2, 64, 16), torch.randn(140, 2, 64, 16)
    tables, pos = torch.stack([torch.randperm(140)[:137] for _ in range(2)]), torch.tensor([[8000, 8703], [100, 5000]])
    o = tk.triton_attention(q[:, :2].contiguous(), kc, vc, tables, pos, 0.25)
    assert close(o, kr.attention_reference(q[:, :2], kc, vc, tables, pos, 0.25)), "long attention"
    # add + RMSNorm of a product's partials (plain and zero-centred, with and without a bias)
    h, w48 = torch.randn(3, 4, 64), torch.randn(48, 64)
    parts, r, w = tk.triton_linear_parts(h, w48), torch.randn(3, 4, 48), torch.randn(48) * 0.3
    assert parts.shape[0] > 1
    for zc in (False, True):
        for bias in (None, torch.randn(48)):
            y, s = tr.triton_add_rms_norm(parts, bias, r, w, 1e-6, zc)
            y0, s0 = kr.add_rms_norm_reference(parts, bias, r, w, 1e-6, zc)
            assert close(y, y0) and torch.equal(s, s0), "norm"
    # q/k norm + rotary with the K/V stores: plain and gated q heads, full and partial rotary, with and without norms
    B, T, H, KV, D = 2, 3, 4, 2, 16
    pos, ws = torch.tensor([[3, 20, 37], [5, 6, 50]]), torch.tensor([[0, 1, 2], [3, 3, 4]])  # blocks of 16
    for gated in (False, True):
        cols = H * D * (2 if gated else 1) + 2 * KV * D
        parts = tk.triton_linear_parts(torch.randn(B, T, 64), torch.randn(cols, 64))
        for rot in (16, 8):
            cos, sin = torch.randn(64, rot), torch.randn(64, rot)
            for qw, kw, zc, bias in ((torch.randn(D), torch.randn(D), False, torch.randn(cols)),
                                     (torch.randn(D), torch.randn(D), True, None),
                                     (torch.empty(0), torch.empty(0), False, None)):
                caches = [torch.zeros(6, KV, 16, D) for _ in range(4)]
                qa, ga = tr.triton_attention_inputs(parts, bias, qw, kw, cos, sin, pos, ws, caches[0], caches[1], H, KV,
                                                    1e-6, zc, gated)
                qb, gb = kr.attention_inputs_reference(parts, bias, qw, kw, cos, sin, pos, ws, caches[2], caches[3], H,
                                                       KV, 1e-6, zc, gated)
                assert close(qa, qb) and close(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "qk"
                assert ga.shape == gb.shape and (not gated or torch.equal(ga, gb)), "gate"
    # SiLU x up and a Gated DeltaNet's output norm (its gate z the product's columns from 8), from partials
    parts = tk.triton_linear_parts(torch.randn(2, 3, 64), torch.randn(96, 64))
    bias = torch.randn(96)
    silu = tr.triton_silu_mul(parts, bias, torch.float32)
    assert close(silu, kr.silu_mul_reference(parts, bias, torch.float32)), "silu"
    x = torch.randn(2, 3, 4, 16)
    assert close(tr.triton_gated_rms_norm(x, parts, 8, w[:16], 1e-6, torch.float32),
                 kr.gated_rms_norm_reference(x, parts, 8, w[:16], 1e-6, torch.float32)), "gated norm"
    # a Gated DeltaNet layer over 21 tokens (row 1 padded after 17): conv (and its next state), gates, the recurrence
    B, T, HK, HV, DK, DV, K = 2, 21, 2, 4, 16, 32, 4  # two key heads, each serving two value heads
    C = 2 * HK * DK + HV * DV
    parts = tk.triton_linear_parts(torch.randn(B, T, 64), torch.randn(C + HV * DV + 2 * HV, 64) * 0.2)
    slots, reads = torch.tensor([3, 1]), torch.tensor([1, 0])
    real = torch.ones(B, T, dtype=torch.long)
    real[1, 17:] = 0
    conv_w, a_log, dt_bias = torch.randn(C, K) * 0.5, torch.randn(HV), torch.randn(HV)
    state = [torch.randn(5, 2, C, K - 1)] * 2
    state = [state[0].clone(), state[0].clone()]
    both = td.triton_causal_conv(parts, state[0], slots, reads, real, conv_w, torch.float32)
    both0 = kr.causal_conv_reference(parts, state[1], slots, reads, real, conv_w, torch.float32)
    assert close(both, both0) and torch.equal(state[0], state[1]), "conv"
    b_col = C + HV * DV
    gates = td.triton_delta_gates(parts, b_col, b_col + HV, a_log, dt_bias, real, torch.float32)
    assert close(gates, kr.delta_gates_reference(parts, b_col, b_col + HV, a_log, dt_bias, real, torch.float32))
    assert not gates[1, 17:].any(), "gates"
    rec = torch.randn(5, 2, HV, DK, DV)
    recs = [rec.clone(), rec.clone()]
    o = td.triton_gated_delta_rule(recs[0], slots, reads, both, gates, HK, 0.25)
    o0 = kr.gated_delta_rule_reference(recs[1], slots, reads, both, gates, HK, 0.25)
    assert close(o, o0, 1e-4) and close(recs[0], recs[1], 1e-4), "delta rule"
    alone = rec.clone()
    o1 = td.triton_gated_delta_rule(alone, slots[1:], reads[1:], both[1:, :5].contiguous(), gates[1:, :5].contiguous(),
                                    HK, 0.25)
    assert torch.equal(o1[0], o[1, :5]), "delta rule rows"
    # the rollback of every layer of two slots in one launch: the state after the first j kept tokens, equal bit for
    # bit to the recurrence run over those j tokens alone; the convolution state the last K - 1 of [state, inputs]
    L, W = 3, 8
    rec, conv = torch.randn(L, 5, 2, HV, DK, DV), torch.randn(L, 5, 2, C, K - 1)
    kept, kept_gates = torch.randn(L, 5, W, 2, C), torch.stack((-torch.rand(L, 5, W, HV), torch.rand(L, 5, W, HV)), 3)
    slots, current, counts = torch.tensor([4, 0]), torch.tensor([0, 1]), torch.tensor([5, 0])
    got, want = (rec.clone(), conv.clone()), (rec.clone(), conv.clone())
    td.triton_rollback(*got, kept, kept_gates, slots, current, counts, HK)
    kr.rollback_reference(*want, kept, kept_gates, slots, current, counts, HK)
    assert close(got[0], want[0], 1e-4) and torch.equal(got[1], want[1]), "rollback"
    assert torch.equal(got[0][:, 0, 1], rec[:, 0, 0]) and torch.equal(got[1][:, 0, 1], conv[:, 0, 0]), "rollback of 0"
    for layer in range(L):
        replay = rec.clone()
        td.triton_gated_delta_rule(replay[layer], slots[:1], 1 - current[:1], kept[layer, 4:5, :5].contiguous(),
                                   kept_gates[layer, 4:5, :5].contiguous(), HK, 0.25)
        assert torch.equal(replay[layer, 4, current[0]], got[0][layer, 4, current[0]]), "rollback = recurrence"
    # the routed experts: 5 tokens, 8 experts, top 2; a token alone equal to the same token among the five
    x, gate_up, down = torch.randn(5, 64), torch.randn(8, 64, 64) * 0.1, torch.randn(8, 64, 32) * 0.1
    ids, weights = torch.stack([torch.randperm(8)[:2] for _ in range(5)]), torch.rand(5, 2)
    y = tk.triton_moe(x, weights, ids, gate_up, down)
    assert close(y, kr.moe_reference(x, weights, ids, gate_up, down)), "moe"
    assert torch.equal(tk.triton_moe(x[2:3], weights[2:3], ids[2:3], gate_up, down)[0], y[2]), "moe rows"
    print("ok")
""")


def test_triton_kernels_in_the_interpreter():
    """The Triton kernels run in Triton's interpreter on CPU tensors: their values against the torch references, and a
    row computed alone equal bit for bit to the same row in a batch."""
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton: the test extra has it)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: graph capture and the Triton kernels")
def test_captured_steps_are_token_identical_in_mixed_batches(variant_dirs):
    """On the GPU in bf16: each request's greedy tokens through captured steps, batched with others at other widths,
    equal its plain decoding alone (one request, width 1)."""
    ck = load_checkpoint(variant_dirs[2])
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(4)]

    def plain(prompt: list[int], n: int) -> list[int]:
        runner = CudaRunner(ck, 1, 256, dtype=torch.bfloat16, device="cuda")
        slot = runner.cache.allocate()
        out = [runner.forward([Segment(slot, prompt, last_only=True)]).greedy[0][1][-1]]
        while len(out) < n:
            out.append(runner.forward([Segment(slot, out[-1:])]).greedy[0][1][-1])
        return out

    alone = [plain(p, 24) for p in prompts]
    runner = CudaRunner(ck, 4, 256, dtype=torch.bfloat16, device="cuda")
    slots = [runner.cache.allocate() for _ in prompts]
    got = [[g[1][-1]] for g in runner.forward([Segment(s, p, last_only=True) for s, p in zip(slots, prompts)]).greedy]
    step = 0
    while min(len(g) for g in got) < 24:  # request i drafts its own future tokens, (i + step) % 8 of them
        segs = []
        for i, (s, g) in enumerate(zip(slots, got)):
            k = (i + step) % 8
            segs.append(Segment(s, [g[-1], *alone[i][len(g) : len(g) + k]]))
        for (s, seg, g), (accepted, ids) in zip(zip(slots, segs, got), runner.forward(segs).greedy):
            g.extend(ids[: accepted + 1])
            runner.cache.set_length(s, runner.cache.lengths[s] - (len(seg.token_ids) - 1 - accepted))
        step += 1
    assert [g[:24] for g in got] == alone
    assert runner.graphs.keys()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "qwen3_next"])
def test_mixture_of_experts_logits_match_transformers(family, tmp_path, tokenizer):
    """The routed experts through `gpu_kernels.moe` (and the hybrids' shared expert): ragged batched forwards equal
    transformers' logits; a second runner over the same checkpoint reads the same stacked and merged weights."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_family(tmp_path / family, family, tokenizer=tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    ck = load_checkpoint(path)
    runner = CudaRunner(ck, 3, 256, (), torch.float32, "cpu")
    _, got = ragged_logits(runner, ids)
    assert max(float((got[b] - ref[b]).abs().max()) for b in range(3)) < 1e-4
    second = CudaRunner(ck, 1, 64, (), torch.float32, "cpu")
    moes = [next(m for m in r.model.modules() if hasattr(m, "experts")) for r in (runner, second)]
    assert moes[0].experts[3].up_proj.weight.data_ptr() == moes[1].experts[3].up_proj.weight.data_ptr()
    attentions = [r.model.layers[-1].self_attn for r in (runner, second)]  # the last layer attends in every family
    assert attentions[0].k_proj.weight.data_ptr() == attentions[1].k_proj.weight.data_ptr()


def test_hybrid_logits_and_rollback_match_transformers(tmp_path, tokenizer):
    """A Qwen3.5 hybrid through the hybrid step: ragged batched forwards equal transformers' logits, and after a verify
    of 6 tokens rolled back to 3 the next decode's logits are those of the 3 committed tokens."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    _, got = ragged_logits(cpu_runner(path, tap_layers=(1, 3)), ids)
    assert max(float((got[b] - ref[b]).abs().max()) for b in range(3)) < 1e-4
    single = cpu_runner(path, num_slots=1)
    slot, seq = single.cache.allocate(), ids[0].tolist()
    single.forward([Segment(slot, seq[:20], last_only=True)])
    single.forward([Segment(slot, seq[20:26])])  # a verify of 6
    single.cache.set_length(slot, 23)  # 3 of them kept
    assert float((single.forward([Segment(slot, seq[23:24])]).logits[0][0] - ref[0, 23]).abs().max()) < 1e-4


def test_a_replayed_bucket_reads_each_calls_inputs(tmp_path, tokenizer):
    """Graphs.emulate runs every call of a bucket with the tensors of its first call, as a replayed graph does: a hybrid
    runner so (padding masks the state updates, so a stale `real` would show) computes what an uncaptured one does
    over ragged batches that share a bucket."""
    path = build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)
    ck = load_checkpoint(path)
    runners = [CudaRunner(ck, 2, 128, (), torch.float32, "cpu") for _ in range(2)]
    runners[0].graphs.emulate = True
    outs = [[], []]
    for runner, out in zip(runners, outs):
        slots = [runner.cache.allocate() for _ in range(2)]
        runner.forward([Segment(s, list(range(5 + s, 30 + s)), last_only=True) for s in slots])
        for lengths in ((3, 1), (1, 4), (3, 2), (4, 3)):  # one bucket, (2, 4), with other padding each time
            result = runner.forward([Segment(s, list(range(40 + n, 40 + 2 * n))) for s, n in zip(slots, lengths)])
            out.append((result.greedy, [t.clone() for t in result.logits]))
    assert runners[0].graphs.keys() == [(2, 4)]
    for (greedy_a, logits_a), (greedy_b, logits_b) in zip(*outs):
        assert greedy_a == greedy_b and all(torch.equal(a, b) for a, b in zip(logits_a, logits_b))


def test_a_rollback_reads_what_its_slot_owns_not_a_replays_outputs(tmp_path, tokenizer):
    """A replay overwrites its graph's outputs (Graphs.emulate does too): two requests verified one after the other in
    one bucket, then both rolled back, decode on as a runner that captures nothing decodes them - what a rollback
    replays lives with its slot, not in the outputs of the replay that computed it."""
    path = build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)
    ck = load_checkpoint(path)
    runners = [CudaRunner(ck, 2, 128, (), torch.float32, "cpu") for _ in range(2)]
    runners[0].graphs.emulate = True
    outs = []
    for runner in runners:
        slots = [runner.cache.allocate() for _ in range(2)]
        runner.forward([Segment(s, list(range(5 + s, 30 + s)), last_only=True) for s in slots])
        for s in slots:  # bucket (1, 8) twice: the second replay overwrites the first one's outputs
            runner.forward([Segment(s, list(range(50 + 3 * s, 58 + 3 * s)))])
        for s, keep in zip(slots, (2, 5)):
            runner.cache.set_length(s, runner.cache.lengths[s] - 8 + keep)
        result = runner.forward([Segment(s, [7 + s]) for s in slots])
        outs.append((result.greedy, [t.clone() for t in result.logits]))
    assert outs[0][0] == outs[1][0] and all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_a_length_set_back_after_a_rollback_ran_replays_the_whole_forward(tmp_path, tokenizer):
    """A verify of 5 rolled back to 2, the rollback run by another slot's forward, then the length set back to all 5:
    the slot decodes as if it had never been rolled back. A forward wider than the kept width keeps nothing, whatever
    its own segment's length: a rollback into it is refused."""
    path = build_tiny_family(tmp_path / "hybrid", "qwen3_5", tokenizer=tokenizer)
    ck = load_checkpoint(path)
    outs = []
    for roll in (False, True):
        runner = CudaRunner(ck, 2, 128, (), torch.float32, "cpu")
        a, b = runner.cache.allocate(), runner.cache.allocate()
        runner.forward([Segment(s, list(range(5 + s, 30 + s)), last_only=True) for s in (a, b)])
        runner.forward([Segment(a, [40, 41, 42, 43, 44])])
        if roll:
            runner.cache.set_length(a, 25 + 2)
            runner.forward([Segment(b, [9])])  # runs the rollback
            runner.cache.set_length(a, 25 + 5)
            runner.cache.set_length(b, 25)
        outs.append(runner.forward([Segment(a, [7])]).logits[0].clone())
    assert torch.equal(outs[0], outs[1])
    runner.forward([Segment(a, [50, 51]), Segment(b, list(range(60, 90)))])  # eager: 30 tokens wide
    with pytest.raises(ValueError, match="holds positions 33..33 of its last forward, not 32"):
        runner.cache.set_length(a, 32)


def test_warm_up_captures_every_bucket_and_touches_no_block(variant_dirs):
    """Every bucket run once; the requests' blocks of the KV cache and the tap buffer keep what they held."""
    runner = CudaRunner(load_checkpoint(variant_dirs[2]), 3, 64, (0, 1), torch.float32, "cpu", warm_up=False)
    runner.graphs.emulate = True  # keys recorded as captures
    for t in (runner.cache.k, runner.cache.v, runner.tap_buffer):
        t.normal_()
    n = runner.cache.num_blocks
    held = [runner.cache.k[:, :n].clone(), runner.cache.v[:, :n].clone(), runner.tap_buffer[:n].clone()]
    runner.warm_up()
    assert runner.graphs.keys() == [(b, w) for b in (1, 2, 3) for w in WIDTHS]
    assert all(torch.equal(a, b) for a, b in zip(held, (runner.cache.k[:, :n], runner.cache.v[:, :n],
                                                         runner.tap_buffer[:n])))
