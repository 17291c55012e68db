"""The DFlash-2 drafter: published checkpoint layout, fit checks, the convolution, one-pass drafting,
the incremental context cache, shared (not copied) target tensors."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.checkpoint import load_checkpoint, load_weights
from blockspec.services.drafter.dflash.checkpoint import check_fits_target, load_drafter
from blockspec.services.drafter.dflash.cpu_block import CpuDrafter
from blockspec.services.drafter.dflash.model import DFlashDrafter, DynamicConv
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent
from blockspec.services.training.tiny import build_tiny_checkpoint, build_tiny_drafter


@pytest.fixture(scope="module")
def drafter_dir(tiny_models, tmp_path_factory):
    return build_tiny_drafter(tmp_path_factory.mktemp("dflash") / "d", tiny_models["qwen3"]["target"])


def test_checkpoint_uses_the_published_layout(drafter_dir):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert {"target_layer_ids", "block_size", "mask_token_id", "conv_kernel_size", "conv_group_size",
            "selector_rank", "selector_top_k"} <= set(cfg["dflash_config"])
    w = load_weights(drafter_dir)
    H, V, r, K, g = cfg["hidden_size"], cfg["vocab_size"], cfg["dflash_config"]["selector_rank"], 2, 16
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    assert w["fc.weight"].shape == (H, n_taps * H)
    assert w["hidden_norm.weight"].shape == (H,) and w["norm.weight"].shape == (H,)
    assert w["layers.0.attention_conv.base_kernel"].shape == (2, K, H)
    assert w["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * K * H // g, H)
    assert w["candidate_selector.hidden_projection.weight"].shape == (r, H)
    assert w["candidate_selector.predecessor_codebook"].shape == (V, r)
    assert w["candidate_selector.successor_codebook"].shape == (V, r)
    for name in ("layers.0.self_attn.q_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.input_layernorm.weight"):
        assert name in w
    assert not any("embed" in n or "lm_head" in n for n in w), "the drafter must not hold the target's embedding/head"


def test_a_synthetic_published_checkpoint_loads(drafter_dir, tmp_path):
    """Weights saved under a `model.` prefix with extra unknown config keys load as the published layout."""
    from safetensors.torch import save_file

    d = tmp_path / "published"
    d.mkdir()
    raw = json.loads((drafter_dir / "config.json").read_text())
    raw.update(layer_types=["sliding_attention"], sliding_window=2048, use_sliding_window=True)
    (d / "config.json").write_text(json.dumps(raw))
    save_file({f"model.{k}": v for k, v in load_weights(drafter_dir).items()}, str(d / "model.safetensors"))
    model = load_drafter(d)
    ref = load_drafter(drafter_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_drafter_that_does_not_fit_the_target_is_refused(drafter_dir, tiny_models, tmp_path):
    other = build_tiny_checkpoint(tmp_path / "wide", "qwen3", hidden_size=96, num_layers=3)
    cfg = load_drafter(drafter_dir).cfg
    with pytest.raises(ModelLoadError, match=r"hidden size 64 \(drafter\) vs 96 \(target\).*num_target_layers 2"):
        check_fits_target(cfg, load_checkpoint(other).config, str(drafter_dir))


def test_conv_is_identity_at_init_and_never_crosses_the_block_start():
    conv = DynamicConv(hidden=32, kernel_size=2, group_size=16)
    x = torch.randn(3, 5, 32)
    assert torch.equal(conv.apply(x, conv.coefficients(x)[:, :, 0]), x)
    with torch.no_grad():
        conv.base_kernel.add_(torch.randn_like(conv.base_kernel))
        conv.kernel_projection.weight.normal_()
    c = conv.coefficients(x)[:, :, 0]
    y = conv.apply(x, c)
    assert torch.allclose(y[:, 0], c[:, 0, 0] * x[:, 0])  # slot 0 reads zero padding, not another block
    assert torch.allclose(y[:, 3], c[:, 3, 0] * x[:, 3] + c[:, 3, 1] * x[:, 2])


def test_one_forward_per_step_shared_tensors_and_cache_equals_recompute(drafter_dir, tiny_models, prompts, monkeypatch):
    engine = Engine(tiny_models["qwen3"]["target"], drafter_dir, "dflash", max_batch=2)
    proposer = engine.proposer
    assert proposer.embedding.data_ptr() == engine.verifier.runner.embedding.data_ptr()
    assert proposer.lm_head.data_ptr() == engine.verifier.runner.lm_head.data_ptr()
    forwards, proposes = [], []
    forward, propose = DFlashDrafter.forward, type(proposer).propose
    monkeypatch.setattr(DFlashDrafter, "forward", lambda self, *a, **kw: forwards.append(1) or forward(self, *a, **kw))
    block, fused = CpuDrafter.block, CpuDrafter.propose  # the same forward in one C++ call, where it applies
    monkeypatch.setattr(CpuDrafter, "block", lambda self, *a, **kw: forwards.append(1) or block(self, *a, **kw))
    monkeypatch.setattr(CpuDrafter, "propose", lambda self, *a, **kw: forwards.append(1) or fused(self, *a, **kw))
    monkeypatch.setattr(type(proposer), "propose", lambda self, inputs: proposes.append(len(inputs)) or propose(self, inputs))
    events = list(engine.generate([engine.request("a", prompts[3], 20, 5), engine.request("b", prompts[4], 20, 5)]))
    finish = [e for e in events if isinstance(e, FinishEvent)]
    # One batched drafter pass per step, whatever the number of requests and k.
    assert len(forwards) == len(proposes) >= max(e.stats.steps for e in finish) - 1 and max(proposes) == 2
    # A fresh proposer that sees the final context at once drafts what the incremental cache drafts.
    from blockspec.common.contracts import ProposeInput

    engine2 = Engine(tiny_models["qwen3"]["target"], drafter_dir, "dflash", max_batch=1)
    ids = list(prompts[5])
    engine2.verifier.add("x", ids)
    engine2.verifier.prefill(["x"])
    committed = engine2.verifier.committed("x")
    incremental = [engine2.proposer.propose([ProposeInput("x", committed[: n + 1], 7)])[0].token_ids
                   for n in range(len(committed) - 10, len(committed))]
    fresh = Engine(tiny_models["qwen3"]["target"], drafter_dir, "dflash", max_batch=1)
    fresh.verifier.add("x", ids)
    fresh.verifier.prefill(["x"])
    assert fresh.proposer.propose([ProposeInput("x", committed, 7)])[0].token_ids == incremental[-1]
    # A retry for the same committed length is idempotent.
    assert engine2.proposer.propose([ProposeInput("x", committed, 7)])[0].token_ids == incremental[-1]


def test_selector_walk_is_argmax_without_pairwise_term_and_follows_it_with_one():
    from blockspec.services.drafter.dflash.config import DFlashConfig
    from blockspec.services.drafter.dflash.model import CandidateSelector

    cfg = DFlashConfig(hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                       vocab_size=10, num_target_layers=2, target_layer_ids=(0,), block_size=4, mask_token_id=9,
                       selector_rank=4, selector_top_k=3)
    sel = CandidateSelector(cfg)
    logits = torch.randn(2, 3, 10)
    hidden = torch.randn(2, 3, 16)
    with torch.no_grad():
        sel.predecessor_codebook.zero_()
    tokens = sel.walk(hidden, logits, torch.tensor([0, 1]))
    assert torch.equal(tokens, logits.argmax(-1))
    # A strong pairwise bonus for (anchor -> the slot's 2nd best candidate) changes the first pick.
    second = logits[0, 0].topk(2).indices[1]
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[:, 0] = 1.0
        sel.predecessor_codebook[0] = 100.0
        sel.successor_codebook.zero_()
        sel.successor_codebook[second] = 1.0 if float(hidden[0, 0, 0]) > 0 else -1.0
    tokens = sel.walk(hidden, logits, torch.tensor([0, 1]))
    assert int(tokens[0, 0]) == int(second)


def test_distillation_is_deterministic_for_a_seed(tiny_models, tmp_path):
    from blockspec.services.training.distill import DistillConfig, train_drafter

    target = tiny_models["qwen3"]["target"]
    sequences = [list(range(5, 45)), list(range(50, 90))]
    cfg = DistillConfig(steps=5, batch_sequences=2, anchors_per_sequence=4)
    a = train_drafter(target, tmp_path / "a", sequences, [8, 8], cfg, progress=False)
    b = train_drafter(target, tmp_path / "b", sequences, [8, 8], cfg, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), DFlashDrafter(a.cfg).state_dict().values()))
