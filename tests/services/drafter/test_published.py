"""DFlash drafters as z-lab publishes them: the config's keys where the reference reads them (block_size at the top
level, dflash_config, sliding-window layers), its module and tensor names, with or without the DFlash-2 modules. They
load, draft what the reference would (the trained block, the first k of it), and stay lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from blockspec.common.contracts import ProposeInput
from blockspec.common.errors import ModelLoadError
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.drafter.dflash.config import DFlashConfig, default_target_layer_ids
from blockspec.services.drafter.dflash.model import DFlashDrafter
from blockspec.services.engine.engine import Engine

WINDOW = 24  # the DFlash-2 drafter's sliding window: shorter than the test prompts, so it binds


def published_config(target: Path, dflash2: bool) -> dict:
    """config.json laid out as z-lab's: a plain DFlash drafter with block_size at the top level (as the Qwen3 DFlash
    drafters), a DFlash-2 one as its Qwen3.5 drafters (sliding-window layers, is_causal false, the module keys and
    logit settings in dflash_config)."""
    t = load_checkpoint(target, with_weights=False)
    H = t.config.hidden_size
    raw = {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 0, "dtype": "float32", "eos_token_id": 0, "head_dim": H // 4,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 2 * H,
        "max_position_embeddings": 512, "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "num_target_layers": t.config.num_layers, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "transformers_version": "5.15.0", "use_cache": False, "vocab_size": t.config.vocab_size,
    }
    mask = t.tokenizer.mask_token_id
    if not dflash2:
        return {**raw, "block_size": 16, "dflash_config": {"mask_token_id": mask, "target_layer_ids": [0, 1]}}
    return {**raw, "is_causal": False, "layer_types": ["sliding_attention", "full_attention"], "max_window_layers": 1,
            "sliding_window": WINDOW, "use_sliding_window": True,
            "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                              "final_logit_softcapping": 20.0, "mask_token_id": mask, "output_multiplier": 0.5,
                              "selector_rank": 16, "selector_top_k": 8, "target_layer_ids": [0, 1]}}


def write_published(out: Path, raw: dict, seed: int = 0) -> Path:
    """The config as given and random weights under the published tensor names (the selector's codebooks bare)."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    torch.manual_seed(seed)
    model = DFlashDrafter(DFlashConfig.from_hf(raw, str(out)))
    state = {k: (torch.randn_like(v) * (0.05 if v.dim() > 1 else 0.3) + (v if v.dim() == 1 else 0)).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def published(tiny_models, tmp_path_factory) -> dict[str, Path]:
    target = tiny_models["qwen3"]["target"]
    root = tmp_path_factory.mktemp("published")
    return {name: write_published(root / name, published_config(target, name == "dflash2"))
            for name in ("dflash", "dflash2")}


def test_the_published_layouts_load_with_the_references_settings(published):
    plain = load_drafter(published["dflash"]).cfg
    assert (plain.block_size, plain.conv_kernel_size, plain.selector_rank, plain.layer_types) == (16, None, None, ())
    two = load_drafter(published["dflash2"])
    cfg = two.cfg
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == WINDOW
    assert (cfg.conv_kernel_size, cfg.selector_rank, cfg.output_multiplier, cfg.is_causal) == (2, 16, 0.5, False)
    assert hasattr(two, "candidate_selector") and hasattr(two.layers[0], "attention_conv")
    assert not hasattr(load_drafter(published["dflash"]), "candidate_selector")


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_drafts_at_k5_are_the_first_five_of_the_k15_block(published, tiny_models, prompts, name):
    """The trained block runs whatever k is asked (as the reference drafts): k = 5 returns the first 5 of its 15."""
    engine = Engine(tiny_models["qwen3"]["target"], published[name], "dflash", max_batch=1, threads=1)
    engine.verifier.add("x", prompts[6])  # 100 tokens: past the sliding window
    engine.verifier.prefill(["x"])
    committed = engine.verifier.committed("x")
    k15 = engine.proposer.propose([ProposeInput("x", committed, 15)])[0].token_ids
    k5 = engine.proposer.propose([ProposeInput("x", committed, 5)])[0].token_ids
    assert len(k15) == 15 and k5 == k15[:5]


@pytest.mark.parametrize("name", ["dflash", "dflash2"])
def test_published_drafters_stay_lossless(published, tiny_models, prompts, references, name):
    engine = Engine(tiny_models["qwen3"]["target"], published[name], "dflash", max_batch=2, threads=1)
    for k in (5, 15):
        done = engine.complete([engine.request(f"{k}-{i}", prompts[i], 64, k) for i in (3, 6)])
        assert [list(d.token_ids) for d in done] == [references["qwen3"][i][:64] for i in (3, 6)]


def test_plain_dflash_takes_the_cpu_fast_path_and_a_sliding_window_the_torch_one(published, tiny_models):
    for name, kernel in (("dflash", "C++"), ("dflash2", "the torch module")):
        engine = Engine(tiny_models["qwen3"]["target"], published[name], "dflash", max_batch=1, threads=1)
        assert engine.proposer.kernel.startswith(kernel), (name, engine.proposer.kernel)


def test_the_sliding_window_hides_context_further_back_than_it(published, tiny_models, prompts, tmp_path):
    """The same weights with a window wider than any context draft as with no window; a binding window drafts other
    tokens (it masks the context before position p - window)."""
    raw = json.loads((published["dflash2"] / "config.json").read_text())
    drafts = {}
    for window in (WINDOW, 4096):
        out = tmp_path / f"w{window}"
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**raw, "sliding_window": window}))
        (out / "model.safetensors").symlink_to(published["dflash2"] / "model.safetensors")
        engine = Engine(tiny_models["qwen3"]["target"], out, "dflash", max_batch=1, threads=1)
        engine.verifier.add("x", prompts[7])  # 150 tokens
        engine.verifier.prefill(["x"])
        drafts[window] = engine.proposer.propose([ProposeInput("x", engine.verifier.committed("x"), 15)])[0].token_ids
    unwindowed = tmp_path / "none"
    unwindowed.mkdir()
    (unwindowed / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in (
        "layer_types", "sliding_window", "use_sliding_window", "max_window_layers")}))
    (unwindowed / "model.safetensors").symlink_to(published["dflash2"] / "model.safetensors")
    engine = Engine(tiny_models["qwen3"]["target"], unwindowed, "dflash", max_batch=1, threads=1)
    engine.verifier.add("x", prompts[7])
    engine.verifier.prefill(["x"])
    assert engine.proposer.propose([ProposeInput("x", engine.verifier.committed("x"), 15)])[0].token_ids == drafts[4096]
    assert drafts[WINDOW] != drafts[4096]


@pytest.mark.parametrize(("where", "key"), [("dflash_config", "rope_interleave"), ("top", "quantization_config")])
def test_a_key_blockspec_does_not_implement_is_refused_by_name(published, tmp_path, where, key):
    raw = json.loads((published["dflash2"] / "config.json").read_text())
    (raw["dflash_config"] if where == "dflash_config" else raw)[key] = {"bits": 4} if where == "top" else True
    out = tmp_path / "d"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=f"unsupported drafter config key\\(s\\) {key}"):
        DFlashConfig.from_hf(raw, str(out))


def test_sampling_top_k_widens_a_sampling_walk_and_is_checked(published):
    """blockspec's own key: absent, a sampling walk keeps the selector's top_k; given, it goes back out in to_hf; under
    top_k or over the vocabulary, refused by name."""
    raw = json.loads((published["dflash2"] / "config.json").read_text())
    assert DFlashConfig.from_hf(raw, "x").sampling_width == 8
    raw["dflash_config"]["sampling_top_k"] = 64
    cfg = DFlashConfig.from_hf(raw, "x")
    assert cfg.sampling_width == 64 and cfg.to_hf()["dflash_config"]["sampling_top_k"] == 64
    for bad in (4, raw["vocab_size"] + 1):
        raw["dflash_config"]["sampling_top_k"] = bad
        with pytest.raises(ModelLoadError, match=f"sampling_top_k {bad} must lie between selector_top_k 8"):
            DFlashConfig.from_hf(raw, "x")


def test_absent_taps_and_block_size_take_the_references_defaults(published):
    raw = json.loads((published["dflash"] / "config.json").read_text())
    del raw["block_size"], raw["dflash_config"]["target_layer_ids"]
    cfg = DFlashConfig.from_hf({**raw, "num_target_layers": 36}, "x")  # two drafter layers over 36 target layers
    assert cfg.block_size == 16 and cfg.target_layer_ids == (1, 33)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61) and default_target_layer_ids(36, 1) == (18,)


def test_a_drafter_for_another_target_is_refused_naming_its_config_and_keys(published, tiny_models, tmp_path):
    raw = json.loads((published["dflash2"] / "config.json").read_text())
    raw["dflash_config"].update(mask_token_id=5000, target_layer_ids=[0, 7])
    out = tmp_path / "d"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    (out / "model.safetensors").symlink_to(published["dflash2"] / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        Engine(tiny_models["qwen3"]["target"], out, "dflash", max_batch=1, threads=1)
    message = str(e.value)
    assert message.startswith(f"{out / 'config.json'}: drafter does not fit the target")
    assert "target_layer_ids [7] outside the target's 2 layers" in message
    assert "mask_token_id 5000 outside the target vocabulary of 320" in message
