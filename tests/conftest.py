"""Shared fixtures: tiny random checkpoints of each family (built once per run), prompts, and the
target-alone reference outputs from transformers `generate`."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from blockspec.services.training.tiny import build_tiny_checkpoint, tiny_tokenizer
from tests.helpers import DRAFT_VOCAB_SIZE, hf_greedy

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPT_LENGTHS = (1, 3, 7, 16, 33, 64, 100, 150)  # tokens; 8 prompts of different lengths

# Tiny models run fastest on one thread, and CI's second core may be busy.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_role_key():
    """A test that starts a server in this process makes up the roles' key in os.environ (`ensure_role_key`): each
    test starts without one and takes its own away when it ends, so roles that later tests (and their module
    fixtures, set up before this fixture) start in-process are not behind a key their callers lack."""
    from blockspec.common.wire.auth import ENV_ROLE_KEY

    saved = os.environ.pop(ENV_ROLE_KEY, None)
    yield
    os.environ.pop(ENV_ROLE_KEY, None)
    if saved is not None:
        os.environ[ENV_ROLE_KEY] = saved


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer) -> dict[str, dict[str, Path]]:
    """{family: {"target": dir, "other": dir}}; "other" is a smaller random model with the same tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        family: {
            "target": build_tiny_checkpoint(root / f"{family}-target", family, seed=0, tokenizer=tokenizer),
            "other": build_tiny_checkpoint(
                root / f"{family}-other", family, seed=1, hidden_size=32, num_layers=1, tokenizer=tokenizer
            ),
        }
        for family in FAMILIES
    }


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Prompt token ids cut from a stdlib module at different offsets and lengths."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "shlex.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    return [ids[200 * i : 200 * i + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def references(tiny_models, prompts) -> dict[str, list[list[int]]]:
    """{family: [target-alone greedy continuation of each prompt]}."""
    return {family: [hf_greedy(dirs["target"], p) for p in prompts] for family, dirs in tiny_models.items()}


# A ChatML-like template that, as real ones do, refuses a conversation whose roles do not alternate, and, as Qwen3's
# and Qwen3.5's do, opens the assistant's turn with an empty think block when `enable_thinking` is false.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def chat_target(tiny_models, tmp_path_factory) -> Path:
    """The qwen3 tiny target with a chat template in its tokenizer_config.json."""
    import json

    out = tmp_path_factory.mktemp("chat") / "qwen3-chat"
    shutil.copytree(tiny_models["qwen3"]["target"], out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="session")
def dflash_drafters(tiny_models, tokenizer, tmp_path_factory) -> dict[str, Path]:
    """{"<family>-random": dir for each family, "qwen3-trained": a drafter distilled from the qwen3 target}."""
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter.dflash import draft_vocab
    from blockspec.services.training.distill import DistillConfig, continuations, train_drafter
    from blockspec.services.training.tiny import build_tiny_drafter

    root = tmp_path_factory.mktemp("dflash")
    out = {f"{f}-random": build_tiny_drafter(root / f"{f}-random", d["target"]) for f, d in tiny_models.items()}
    target = tiny_models["qwen3"]["target"]
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    prompts = [ids[97 * i : 97 * i + 24] for i in range(64)]
    sequences = continuations(target, prompts, 64, progress=False)
    train_drafter(target, root / "qwen3-trained", sequences, [24] * len(prompts), DistillConfig(steps=150), progress=False)
    out["qwen3-trained"] = root / "qwen3-trained"
    # The same drafter with a draft vocabulary: the 128 most frequent tokens of its supervision, of 320.
    out["qwen3-trained-vocab"] = root / "qwen3-trained-vocab"
    shutil.copytree(out["qwen3-trained"], out["qwen3-trained-vocab"])
    config = load_checkpoint(target, with_weights=False).config
    draft_vocab.build(out["qwen3-trained-vocab"], config.vocab_size, config.eos_token_ids, sequences, DRAFT_VOCAB_SIZE,
                      "test sequences")
    return out


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """`build-default --profile tiny`: a trained target (peaked distributions) and its distilled drafter."""
    from blockspec.services.training.default_pair import build_default

    return build_default("tiny", tmp_path_factory.mktemp("pairs"), threads=1)
