"""Tap features as the reference reads them: for target_layer_ids the concatenation, in the listed order, of
transformers' hidden_states[i + 1] (`extract_context_feature` in z-lab's dflash), whose last entry is the final norm's
output. Checked for every layer id, the last one included, in each runner path that stores taps."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.models.kv_cache import slot_rows
from blockspec.common.runtime.cuda_runner import CudaRunner
from blockspec.common.runtime.runner import Runner, Segment
from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.drafter.dflash.config import DFlashConfig
from blockspec.services.training.tiny import build_family, build_tiny_drafter
from tests.helpers import base_config

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5")


def reference_features(path, prompt: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The reference's reading: torch.cat([hidden_states[i + 1] for i in layer_ids], -1) of the target alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden_states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)[0]


def drafter_config(num_target_layers: int, layer_ids: tuple[int, ...], **changes) -> DFlashConfig:
    return DFlashConfig(hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=16,
                        vocab_size=320, num_target_layers=num_target_layers, target_layer_ids=layer_ids, block_size=4,
                        mask_token_id=1, **changes)


def stored_taps(runner, prompt: list[int]) -> torch.Tensor:
    """The runner's tap buffer over the prompt, run as a prefill of all but its last 3 tokens (a chunk) and three
    single-token steps (decodes: the C++ path on the CPU where the model takes it)."""
    dest = runner.make_tap_buffer()
    slot = runner.cache.allocate()
    runner.forward([Segment(slot, prompt[:-3])], dest)
    for token in prompt[-3:]:
        runner.forward([Segment(slot, [token])], dest)
    return slot_rows(dest, runner.cache.table)[slot][: len(prompt)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_id_is_tapped_as_the_reference_reads_it(family, tokenizer, prompts, tmp_path):
    config = base_config(family, len(tokenizer))
    path = build_family(tmp_path / family, family, config, tokenizer=tokenizer, weight_scale=3.0)
    layers = config["num_hidden_layers"]
    layer_ids = tuple(range(layers))
    points = drafter_config(layers, layer_ids).tap_points
    assert points == (*range(layers - 1), layers)  # the last layer: the final norm's output
    prompt = prompts[4][:20]
    want = reference_features(path, prompt, layer_ids)
    eager = Runner(load_checkpoint(path), num_slots=2, max_len=64, tap_layers=points)
    cuda = CudaRunner(load_checkpoint(path), 1, 64, points, torch.float32, "cpu")
    for name, runner in (("eager", eager), ("cuda", cuda)):
        got = stored_taps(runner, prompt)
        tol = 1e-5 * max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= tol, name
    slot = eager.cache.allocate()  # the rows a forward returns when it is given no buffer
    rows = eager.forward([Segment(slot, prompt)]).tap_rows
    assert float((rows - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


def test_a_drafter_trained_on_the_unnormed_last_layer_says_so():
    cfg = drafter_config(4, (0, 2, 3), last_tap_before_norm=True)
    assert cfg.tap_points == (0, 2, 3)
    assert DFlashConfig.from_hf(cfg.to_hf(), "x").last_tap_before_norm
    assert drafter_config(4, (0, 2, 3)).tap_points == (0, 2, 4)


def test_layer_ids_in_any_order_and_repeated_read_the_same_features(tiny_models, tokenizer, tmp_path):
    """A drafter listing [1, 0, 1] concatenates hidden_states[2], [1], [2] as the reference does; loaded, it reads the
    verifier's taps (0, 1) once each, its fc arranged for them: the same context."""
    target = tiny_models["qwen3"]["target"]
    listed = build_tiny_drafter(tmp_path / "listed", target, target_layer_ids=(1, 0, 1))
    drafter = load_drafter(listed)
    assert drafter.cfg.target_layer_ids == (0, 1) and drafter.cfg.tap_points == (0, 2)
    fc = load_file(str(listed / "model.safetensors"))["fc.weight"]  # [H, 3 H]: the listed order
    features = {i: torch.randn(5, 64) for i in (0, 1)}
    want = torch.cat([features[i] for i in (1, 0, 1)], dim=-1) @ fc.T
    got = drafter.fc(torch.cat([features[i] for i in (0, 1)], dim=-1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_refinement_keeps_its_drafters_taps(tiny_models, tmp_path):
    from blockspec.services.training.distill import DistillConfig
    from blockspec.services.training.distill import drafter_config as distill_config

    target = tiny_models["qwen3"]["target"]
    old = build_tiny_drafter(tmp_path / "old", target, target_layer_ids=(1,))
    raw = load_drafter(old).cfg
    (tmp_path / "old" / "config.json").write_text(json.dumps(dataclasses.replace(raw, last_tap_before_norm=True).to_hf()))
    cfg = distill_config(target, DistillConfig(init_from=str(tmp_path / "old")))
    assert cfg.target_layer_ids == (1,) and cfg.last_tap_before_norm and cfg.tap_points == (1,)
