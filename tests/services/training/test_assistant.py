"""The pair's assistant (a small causal draft model): trained on the target's continuations, resumable,
and measured by `blockspec bench` as draft_model and transformers assisted generation, losslessly."""

from __future__ import annotations

import json
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest

from blockspec.services.cli.main import main
from blockspec.services.training.assistant import AssistantConfig, train_assistant
from blockspec.services.training.distill import continuations as target_continuations

SMALL = AssistantConfig(hidden_size=32, intermediate_size=64, num_layers=1, steps=200, batch_sequences=16,
                        warmup_steps=10, heldout_sequences=40, checkpoint_s=0.0)


@pytest.fixture(scope="module")
def continuations(tiny_pair) -> list[list[int]]:
    from transformers import AutoTokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / n).read_text(encoding="utf-8") for n in ("textwrap.py", "string.py"))
    ids = AutoTokenizer.from_pretrained(str(tiny_pair.target)).encode(text)
    return target_continuations(tiny_pair.target, [ids[41 * i : 41 * i + 16] for i in range(240)], 32, progress=False)


@pytest.fixture(scope="module")
def assistant(tiny_pair, continuations, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("assistant") / "assistant"
    train_assistant(tiny_pair.target, out, continuations, 16, SMALL, progress=False)
    return out


def test_the_assistant_learns_the_targets_continuations(assistant, continuations, tiny_pair, tmp_path):
    report = json.loads((assistant / "training.json").read_text())
    assert report["steps"] == SMALL.steps and report["sequences"] == len(continuations) - SMALL.heldout_sequences
    # Held-out continuations (40 sequences): the untrained model agreed with 0.22 of the target's tokens
    # (its tied embeddings copy the last token, and the tiny target repeats itself), the trained one 0.64.
    untrained = train_assistant(tiny_pair.target, tmp_path / "untrained", continuations, 16,
                                replace(SMALL, steps=0), progress=False)
    assert report["heldout_agreement"] > untrained["heldout_agreement"] + 0.2
    assert report["heldout_loss"] < untrained["heldout_loss"] - 2.0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(assistant)
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_pair.target).config.vocab_size
    assert AutoTokenizer.from_pretrained(str(assistant)).encode("def f():") == \
        AutoTokenizer.from_pretrained(str(tiny_pair.target)).encode("def f():")


def test_training_resumes_from_its_checkpoint(tiny_pair, continuations, tmp_path, monkeypatch, caplog):
    from blockspec.services.training import assistant as module

    whole = replace(SMALL, steps=30)
    real_save, saved = module.save_checkpoint, []

    def crash_after_step_20(path, state):  # a checkpoint after every step (checkpoint_s=0); killed after the 20th
        real_save(path, state)
        saved.append(state["step"])
        if state["step"] == 20:
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "save_checkpoint", crash_after_step_20)
    with pytest.raises(KeyboardInterrupt):
        train_assistant(tiny_pair.target, tmp_path / "a", continuations, 16, whole, work=tmp_path, progress=False)
    assert saved[-1] == 20 and not (tmp_path / "a").exists()
    monkeypatch.setattr(module, "save_checkpoint", real_save)
    with caplog.at_level("INFO", logger=module.__name__):
        resumed = train_assistant(tiny_pair.target, tmp_path / "a", continuations, 16, whole, work=tmp_path, progress=False)
    assert "resumed at step 20 of 30" in caplog.text  # ten more steps, not thirty
    straight = train_assistant(tiny_pair.target, tmp_path / "b", continuations, 16, whole, progress=False)
    assert resumed["steps"] == straight["steps"] == 30
    assert resumed["train_loss"] == pytest.approx(straight["train_loss"], rel=1e-4)
    assert resumed["heldout_loss"] == pytest.approx(straight["heldout_loss"], rel=1e-4)


def test_bench_runs_draft_model_and_transformers_assisted_with_the_same_assistant(tiny_pair, assistant, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def wrap(self, text):\\n"\n"class TextWrapper:\\n    "\n')
    out = tmp_path / "out"
    args = ["bench", "--target", str(tiny_pair.target), "--drafter", str(tiny_pair.drafter), "--prompts-file",
            str(prompts), "--max-tokens", "24", "--concurrency", "1", "--out", str(out), "--threads", "1",
            "--rounds", "1", "--waves", "1"]
    assert main([*args, "--modes", "draft_model:3,hf-assisted:3,hf-assisted-default:3", "--assistant", str(assistant)]) == 0
    rows = {r["mode"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert set(rows) == {"none", "draft_model", "hf-assisted", "hf-assisted-default"}
    assert all(r["exact"] for r in rows.values()), "every mode must reproduce plain decoding token for token"
    assert rows["draft_model"]["tau"] > 1 and sum(rows["draft_model"]["accepted_per_pos"]) > 0
    assert main([*args, "--modes", "hf-assisted:3", "--assistant", ""]) == 2  # no draft model: the flag is named


def test_build_assistant_needs_a_built_base_pair(tmp_path, capsys):
    assert main(["build-assistant", "--home", str(tmp_path)]) == 2
    assert "--home" in capsys.readouterr().err
