"""Distillation for sampled requests (services/training/distill.py): continuations sampled at the requests'
temperatures, seeded; the soft term on the target's distribution; a run interrupted after a checkpoint resumes to
the drafter the uninterrupted run gives."""

from __future__ import annotations

import json
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from blockspec.services.drafter.dflash.checkpoint import load_drafter
from blockspec.services.training import distill
from blockspec.services.training.distill import DistillConfig, continuations, train_drafter

SMALL = DistillConfig(steps=12, batch_sequences=4, anchors_per_sequence=4, checkpoint_every=5, warmup_steps=2,
                      temperatures=(0.0, 0.7, 1.0), kl_weight=1.0, kl_top_k=8, selector_kl_weight=0.5)


@pytest.fixture(scope="module")
def supervision(tiny_models, tokenizer) -> tuple[Path, list[list[int]], list[list[int]]]:
    target = tiny_models["qwen3"]["target"]
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    prompts = [ids[97 * i : 97 * i + 24] for i in range(12)]
    return target, prompts, continuations(target, prompts, 32, progress=False, temperatures=SMALL.temperatures)


def test_sampled_continuations_are_seeded_and_greedy_where_asked(supervision):
    target, prompts, sequences = supervision
    assert continuations(target, prompts, 32, progress=False, temperatures=SMALL.temperatures) == sequences
    greedy = continuations(target, prompts, 32, progress=False)
    assert [s for i, s in enumerate(sequences) if i % 3 == 0] == [s for i, s in enumerate(greedy) if i % 3 == 0]
    sampled = [i for i in range(len(prompts)) if i % 3]
    assert any(sequences[i] != greedy[i] for i in sampled)  # T 0.7 and 1.0 leave the argmax somewhere
    other = continuations(target, prompts, 32, progress=False, temperatures=SMALL.temperatures, seed=1)
    assert any(other[i] != sequences[i] for i in sampled)


def test_the_soft_term_is_trained_and_an_interrupted_run_resumes_to_the_same_drafter(supervision, tmp_path,
                                                                                    monkeypatch):
    target, prompts, sequences = supervision
    lens = [len(p) for p in prompts]
    whole = train_drafter(target, tmp_path / "whole", sequences, lens, SMALL, progress=False)
    meta = load_drafter(tmp_path / "whole")  # noqa: F841 - it loads: a drafter the roles can serve
    trained = json.loads((tmp_path / "whole" / "config.json").read_text())["blockspec_training"]
    assert trained["kl"] >= 0 and trained["selector_soft"] > 0  # both soft terms: the drafter's and the selector's
    assert not (tmp_path / "whole" / "train_state.pt").exists()

    real, calls = distill.block_loss, []

    def dies_at_step_8(*args):
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt  # a kill after the checkpoint of step 5
        return real(*args)

    monkeypatch.setattr(distill, "block_loss", dies_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, tmp_path / "resumed", sequences, lens, SMALL, progress=False)
    assert torch.load(tmp_path / "resumed" / "train_state.pt", weights_only=False)["step"] == 5
    monkeypatch.setattr(distill, "block_loss", real)
    resumed = train_drafter(target, tmp_path / "resumed", sequences, lens, SMALL, progress=False)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    # Another config does not take the state of this one.
    stale = replace(SMALL, seed=1)
    monkeypatch.setattr(distill, "block_loss", dies_at_step_8)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target, tmp_path / "other", sequences, lens, SMALL, progress=False)
    monkeypatch.setattr(distill, "block_loss", real)
    assert distill._resume(tmp_path / "other" / "train_state.pt", {"config": repr(stale), "supervision": "x"},
                           None, None, None, None) == 0



def test_a_warm_start_may_add_layers_that_start_as_the_identity(supervision, tmp_path):
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.common.models.decoder import rope_table
    from blockspec.common.runtime.runner import Runner
    from blockspec.services.drafter.dflash.model import DFlashDrafter

    target, prompts, sequences = supervision
    lens = [len(p) for p in prompts]
    one = train_drafter(target, tmp_path / "one", sequences, lens, replace(SMALL, steps=3, kl_weight=0.0), progress=False)
    grown = DFlashDrafter(distill.drafter_config(target, replace(SMALL, num_layers=2))).eval()
    distill.warm_start(grown, tmp_path / "one")
    assert len(grown.layers) == 2 and grown.layers[1].mlp.down_proj.weight.abs().sum() == 0
    runner = Runner(load_checkpoint(target), num_slots=8, max_len=max(map(len, sequences)) + 1,
                    tap_layers=one.cfg.target_layer_ids)
    batcher = distill._Batcher(sequences, lens, distill.tap_features(runner, sequences), one.cfg.block_size,
                               np.random.default_rng(0))
    cos, sin = rope_table(one.cfg, runner.max_len + one.cfg.block_size)
    batch = batcher.sample(4, 4)
    with torch.no_grad():
        before = distill.draft_block(one, runner.embedding, runner.lm_head, cos, sin, batch)[1]
        after = distill.draft_block(grown, runner.embedding, runner.lm_head, cos, sin, batch)[1]
    assert torch.allclose(before, after, atol=1e-5)  # the added layer changes nothing until it trains
    # Training the grown drafter from there moves the new layer.
    trained = train_drafter(target, tmp_path / "two", sequences, lens,
                            replace(SMALL, steps=3, num_layers=2, init_from=str(tmp_path / "one")), progress=False)
    assert trained.layers[1].mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(ValueError, match="2 layers; cannot start a drafter of 1"):
        distill.warm_start(DFlashDrafter(one.cfg), tmp_path / "two")
    # selector_only: the selector (here widened to 32 candidates) trains on its own; every other weight stays. The
    # sampling walk's width goes into the saved config.
    widened = train_drafter(target, tmp_path / "sel", sequences, lens,
                            replace(SMALL, steps=3, init_from=str(tmp_path / "one"), selector_only=True,
                                    selector_top_k=32, sampling_top_k=64), progress=False)
    assert widened.cfg.selector_top_k == 32 and widened.cfg.sampling_width == 64
    assert load_drafter(tmp_path / "sel").cfg.sampling_width == 64
    for (name, a), b in zip(one.state_dict().items(), widened.state_dict().values()):
        assert torch.equal(a, b) != name.startswith("candidate_selector."), name
