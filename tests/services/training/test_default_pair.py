"""`blockspec build-default --profile tiny`: train a target, distil a drafter, generate losslessly."""

from __future__ import annotations

import json

from blockspec.services.cli.main import main
from tests.helpers import hf_greedy


def test_build_default_tiny_end_to_end(tiny_pair, capsys, monkeypatch):
    """tiny_pair (conftest) is what build-default --profile tiny builds; the command finds it at once."""
    from blockspec.services.training import default_pair

    tmp_path = tiny_pair.root.parent

    def rebuilt(*args, **kwargs):
        raise AssertionError("an existing pair is returned without rebuilding")

    monkeypatch.setattr(default_pair, "build_tiny", rebuilt)
    assert main(["build-default", "--profile", "tiny", "--home", str(tmp_path), "--json"]) == 0
    monkeypatch.undo()
    paths = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert paths == {"target": str(tiny_pair.target), "drafter": str(tiny_pair.drafter)}
    card = json.loads((tmp_path / "tiny" / "card.json").read_text())
    dflash5 = next(r for r in card["tau"] if r["method"] == "dflash" and r["k"] == 5)
    assert dflash5["tau"] > 1.0, "the distilled drafter must get drafts accepted"
    assert main(["info", str(tmp_path / "tiny")]) == 0
    assert "tau" in capsys.readouterr().out
    # The pair generates exactly what the target alone generates.
    from transformers import AutoTokenizer

    prompt = "def fill(text, width=70):"
    ids = AutoTokenizer.from_pretrained(paths["target"]).encode(prompt)
    assert main(["generate", prompt, "--target", paths["target"], "--drafter", paths["drafter"], "-k", "7",
                 "--max-tokens", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(paths["target"], ids, 64)
    assert out["stats"]["drafted"] > 0
