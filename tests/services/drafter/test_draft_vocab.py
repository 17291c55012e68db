"""Draft vocabularies (dflash/draft_vocab.py): which tokens are kept, the file, its loading and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from blockspec.common.errors import ModelLoadError
from blockspec.services.cli.main import main
from blockspec.services.drafter.dflash import draft_vocab
from blockspec.services.drafter.dflash.checkpoint import load_drafter


def test_choose_keeps_the_most_frequent_tokens_sorted():
    streams = [[5] * 9 + [7] * 4 + [3] * 4 + [200] * 2, [9, 9, 9, 130]]  # 3 and 7 tie: the lower id first
    ids, stats = draft_vocab.choose(streams, 64, 256)
    assert ids == sorted(ids) and len(ids) == 64
    assert {5, 7, 3, 9, 200, 130} <= set(ids)
    # Unused ids fill the rest, lowest first: 0..63 less the ones taken by used tokens above 63.
    assert set(ids) == {5, 7, 3, 9, 200, 130} | set([t for t in range(64) if t not in (3, 5, 7, 9)][:58])
    assert stats == {"corpus_tokens": 23, "distinct_tokens": 6, "coverage": 1.0}
    ids, stats = draft_vocab.choose(streams, 64, 256, always=[255])  # an end-of-sequence id is always kept
    assert 255 in ids and stats["coverage"] == 1.0
    few = draft_vocab.choose([[t for t in range(100) for _ in range(100 - t)] + [250] * 500], 64, 256)
    assert 250 in few[0] and 99 not in few[0] and few[1]["coverage"] < 1.0


@pytest.mark.parametrize("size", [0, 100, 320])
def test_sizes_must_be_whole_panels_within_the_vocabulary(size):
    with pytest.raises(ValueError, match="multiple of 64"):
        draft_vocab.choose([[1, 2]], size, 256)


def test_tokens_outside_the_vocabulary_are_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draft_vocab.choose([[1, 300]], 64, 256)


def test_written_vocabulary_loads_with_its_drafter(tiny_models, tmp_path):
    from blockspec.services.training.tiny import build_tiny_drafter

    path = build_tiny_drafter(tmp_path / "d", tiny_models["qwen3"]["target"])
    assert load_drafter(path).draft_vocab is None
    info = draft_vocab.build(path, 320, [0], [list(range(10, 80)) * 3], 64, "a test")
    assert info == {"size": 64, "source": "a test", "corpus_tokens": 210, "distinct_tokens": 70, "coverage": 63 / 70}  # 0 forced
    loaded = load_drafter(path).draft_vocab
    assert loaded.tolist() == json.loads((path / draft_vocab.FILE).read_text())["token_ids"]
    assert loaded.tolist()[0] == 0 and len(loaded) == 64
    assert draft_vocab.build(path, 320, [], [[1]], None, "default size")["size"] == 128  # half, rounded to panels


@pytest.mark.parametrize("ids", [[3, 2] + list(range(4, 66)), list(range(63)), list(range(257, 321)), "x",
                                 [0.5] + list(range(1, 64))])
def test_a_bad_file_is_refused_naming_it(tiny_models, tmp_path, ids):
    from blockspec.services.training.tiny import build_tiny_drafter

    path = build_tiny_drafter(tmp_path / "d", tiny_models["qwen3"]["target"])
    (path / draft_vocab.FILE).write_text(json.dumps({"token_ids": ids}))
    with pytest.raises(ModelLoadError, match="draft_vocab.json"):
        load_drafter(path)


def test_cli_writes_the_vocabulary_and_names_a_bad_size(capsys, tiny_models, dflash_drafters, tmp_path):
    drafter = tmp_path / "drafter"
    shutil.copytree(dflash_drafters["qwen3-trained"], drafter)
    text = tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 50)
    target = str(tiny_models["qwen3"]["target"])
    args = ["draft-vocab", "--drafter", str(drafter), "--target", target, "--text-file", str(text)]
    assert main(args + ["--size", "64"]) == 0
    assert "64 of 320 tokens, 100.0% of the" in capsys.readouterr().out
    assert len(load_drafter(drafter).draft_vocab) == 64
    (drafter / draft_vocab.FILE).write_text("{broken")  # a bad file is replaced, not read
    assert main(args + ["--size", "128"]) == 0
    assert len(load_drafter(drafter).draft_vocab) == 128
    assert main(args + ["--size", "100"]) == 2
    assert "--size" in capsys.readouterr().err
    assert main(["draft-vocab", "--drafter", str(drafter), "--target", target, "--text-file", str(tmp_path / "no")]) == 2
    assert "--text-file" in capsys.readouterr().err
