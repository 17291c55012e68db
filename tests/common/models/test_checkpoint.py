"""Checkpoint loading: clear errors naming the path and what was expected."""

from __future__ import annotations

import json
import shutil

import pytest

from blockspec.common.errors import ModelLoadError
from blockspec.common.models.checkpoint import check_same_tokenizer, load_checkpoint
from blockspec.services.training.tiny import build_tiny_checkpoint, tiny_tokenizer


def copy_of(src, tmp_path, name="ck"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_loads_each_family(tiny_models):
    for family, dirs in tiny_models.items():
        ck = load_checkpoint(dirs["target"])
        assert ck.config.family == family and ck.weights and ck.tokenizer is not None


def test_missing_directory_and_files(tmp_path, tiny_models):
    with pytest.raises(ModelLoadError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    ck = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    (ck / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_checkpoint(ck)
    ck2 = copy_of(tiny_models["qwen3"]["target"], tmp_path, "ck2")
    (ck2 / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="missing tokenizer file"):
        load_checkpoint(ck2)
    ck3 = copy_of(tiny_models["qwen3"]["target"], tmp_path, "ck3")
    (ck3 / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_checkpoint(ck3)


def test_unsupported_architecture_names_the_found_and_supported(tmp_path, tiny_models):
    ck = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*gpt2.*llama, qwen2, qwen3") as e:
        load_checkpoint(ck)
    assert str(ck) in str(e.value)


def test_tokenizer_mismatch_is_refused_saying_how(tmp_path, tiny_models):
    other = build_tiny_checkpoint(tmp_path / "other-vocab", "qwen3", tokenizer=tiny_tokenizer(300))
    with pytest.raises(ModelLoadError, match=r"drafter tokenizer differs.*vocabulary sizes 300 \(drafter\) vs 320"):
        check_same_tokenizer(load_checkpoint(tiny_models["qwen3"]["target"]), load_checkpoint(other))


def test_a_drafter_whose_logits_cover_more_ids_than_the_target_is_refused(tmp_path, tiny_models):
    """The same tokenizer, but padded logits (vocab_size past the target's): its drafts or their q could name ids
    the target does not have (an index error in the rejection rule, a bad embedding lookup)."""
    target = load_checkpoint(tiny_models["qwen3"]["target"])
    padded = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    cfg = json.loads((padded / "config.json").read_text())
    cfg["vocab_size"] = target.config.vocab_size + 64
    (padded / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=rf"its logits cover {target.config.vocab_size + 64} ids"):
        check_same_tokenizer(target, load_checkpoint(padded, with_weights=False))


def test_unreadable_weights_name_the_file(tmp_path, tiny_models):
    """A truncated safetensors file (a copy cut short, a full disk) is a load error naming the file, not a
    safetensors traceback."""
    broken = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=rf"{weights}: cannot read the weights"):
        load_checkpoint(broken)


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path, tiny_models):
    """A sharded checkpoint (model.safetensors.index.json) copied without one of its shards."""
    from safetensors.torch import load_file, save_file

    ck = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    weights = load_file(str(ck / "model.safetensors"))
    (ck / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(ck / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_checkpoint(ck).weights.keys() == weights.keys()
    (ck / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"index.json: weight_map names 1 shard\(s\) not in the directory: "
                                             r"model-00002-of-00002.safetensors"):
        load_checkpoint(ck)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, tiny_models):
    ck = copy_of(tiny_models["qwen3"]["target"], tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: 320 tokens \(with the added ones\) do not fit "
                                             r"config.json's vocab_size 300"):
        load_checkpoint(ck)
