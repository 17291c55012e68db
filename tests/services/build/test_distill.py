"""Distillation for sampled requests (services/build/distill.py): continuations sampled at the requests'
temperatures, seeded; the soft term on the target's distribution; a run interrupted after a checkpoint resumes to
the drafter the uninterrupted run gives."""

from __future__ import annotations

import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from blockspec.services.build import distill
from blockspec.services.build.distill import DistillConfig, continuations, train_drafter
from blockspec.services.drafter.dflash.checkpoint import load_drafter

SMALL = DistillConfig(steps=12, batch_sequences=4, anchors_per_sequence=4, checkpoint_every=5, warmup_steps=2,
                      temperatures=(0.0, 0.7, 1.0), kl_weight=1.0, kl_top_k=8)


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

