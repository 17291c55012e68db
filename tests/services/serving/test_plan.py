"""`blockspec plan`: the start-up checks' arithmetic from the configs alone - the shipped pair, a 27B dense target and a
Qwen3.5-27B-shaped hybrid with a DFlash drafter shaped as the published 27B one, on 80 GB and 141 GB cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from blockspec.common.config import load_config
from blockspec.services.cli.main import main
from blockspec.services.serving.plan import GIB, parse_size, plan_capacity

ROOT = Path(__file__).resolve().parents[3]


def write_config(tmp_path: Path, target: Path, drafter: Path | None, max_batch: int = 16, **model) -> Path:
    doc = {"server": {"max_batch": max_batch}, "model": {"target_model_path": str(target), "device": "cuda",
                                                   "dtype": "bfloat16", "max_model_len": 4096, **model}}
    if drafter is not None:
        doc["model"]["draft_model_path"] = str(drafter)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def reference_pairs(tmp_path_factory, tokenizer) -> dict[str, tuple[Path, Path]]:
    """Config-only checkpoints (config.json and tokenizer, no weights) of the 27B shapes and their drafters."""
    from blockspec.common.models.model_config import parse_config
    from blockspec.services.bench.gpu_sizes import hf_config, random_drafter

    root = tmp_path_factory.mktemp("plans")
    pairs = {}
    for size in ("27b", "27b-hybrid"):
        raw = {**hf_config(size), "max_position_embeddings": 32768}
        target = root / f"{size}-target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps(raw))
        tokenizer.save_pretrained(target)
        with torch.device("meta"):
            drafter_cfg = random_drafter(size, parse_config(raw, target), "meta", torch.bfloat16).cfg
        drafter = root / f"{size}-drafter"
        drafter.mkdir()
        (drafter / "config.json").write_text(json.dumps(drafter_cfg.to_hf()))
        pairs[size] = (target, drafter)
    return pairs


def test_sizes_parse_and_bad_ones_name_the_flag():
    assert parse_size("80GB") == 80 * 10**9 and parse_size("80GiB") == 80 * GIB and parse_size("512MiB") == 2**29
    assert parse_size("1000") == 1000
    with pytest.raises(Exception, match="--gpu-memory"):
        parse_size("lots")


def test_the_shipped_pairs_plan_counts_what_the_start_up_checks_count(monkeypatch):
    """The verifier's need equals `Verifier.static_bytes` of the loaded target (the start-up check's figure, weights
    counted from the tensors), the drafter's what its role claims before it loads."""
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter import service
    from blockspec.services.drafter.dflash.checkpoint import load_drafter
    from blockspec.services.verifier.verifier import Verifier

    cfg = load_config(ROOT / "deploy" / "config.yaml")
    plan = plan_capacity(cfg, 80 * 10**9)
    assert plan.fits and plan.method == "dflash" and plan.graphs and [r.role for r in plan.roles] == ["verifier",
                                                                                                      "drafter"]
    verifier, drafter = plan.roles
    target = load_checkpoint(cfg.model.target_model_path)
    taps = load_drafter(cfg.model.draft_model_path).cfg.target_layer_ids
    assert verifier.need == Verifier.static_bytes(target, verifier.slots, verifier.max_len, taps, torch.float32, True)
    claimed = []
    monkeypatch.setattr(service, "claim_gpu_share", lambda device, fraction, need, role: claimed.append(need))
    service._claim_share("dflash", None, load_drafter(cfg.model.draft_model_path), drafter.slots, drafter.max_len,
                         torch.device("cuda"), torch.float32, 0.1)
    assert claimed == [drafter.need]


@pytest.mark.parametrize("size", ["27b", "27b-hybrid"])
def test_27b_pairs_on_80_and_141_gb(size, reference_pairs, tmp_path, capsys):
    """16 slots of 4096 tokens: too much for the verifier's share of an 80 GB card (the plan says what fits instead),
    within a 141 GB card's. The advice is a configuration that fits."""
    target, drafter = reference_pairs[size]
    config = write_config(tmp_path, target, drafter)
    assert main(["plan", "--config", str(config), "--gpu-memory", "141GB"]) == 0
    assert "Every role fits." in capsys.readouterr().out
    assert main(["plan", "--config", str(config), "--gpu-memory", "80GB", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    verifier = report["roles"][0]
    assert not report["fits"] and not verifier["fits"] and report["roles"][1]["fits"]
    assert 45 * GIB < verifier["weights"] < verifier["share"] < verifier["need"]  # ~50 GiB of weights fit, slots not
    assert 0 < verifier["max_slots"] < 16 and verifier["longest"] < 4096
    assert f"server.max_batch {verifier['max_slots']}" in report["advice"][0]
    # a hybrid's states are a fixed cost a slot: no context length brings 16 of them under the share
    assert (verifier["longest"] == 0) == (size == "27b-hybrid") == ("model.max_model_len" not in report["advice"][0])
    for slots, fits in ((verifier["max_slots"], True), (verifier["max_slots"] + 1, False)):  # the advice, taken
        cfg = load_config(write_config(tmp_path, target, drafter, max_batch=slots))
        assert plan_capacity(cfg, 80 * 10**9).roles[0].fits == fits
    if verifier["longest"]:
        for length, fits in ((verifier["longest"], True), (verifier["longest"] + 64, False)):
            cfg = load_config(write_config(tmp_path, target, drafter, max_model_len=length))
            assert plan_capacity(cfg, 80 * 10**9).roles[0].fits == fits


def test_a_cpu_config_is_planned_in_the_ram_available(monkeypatch, capsys):
    """`plan` on a CPU config (the shipped one) answers without --gpu-memory (it was exit code 2 asking for it): the
    RAM psutil says is available, the CPU runner's count (no spare slot, no captured steps: `Verifier.static_bytes`
    with graphs off), the GPU plan's table and JSON. Too little RAM is exit code 1 with what to lower; --gpu-memory
    still plans as on a GPU of that size."""
    import psutil

    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter.dflash.checkpoint import load_drafter
    from blockspec.services.verifier.verifier import Verifier

    config = str(ROOT / "deploy" / "config.yaml")
    ram = {"total": 64 * GIB, "available": 48 * GIB}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Ram", (), ram)())
    assert main(["plan", "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["device"], report["memory_bytes"], report["memory"], report["graphs"], report["fits"]) == (
        "cpu", 48 * GIB, "available now, of 64.0 GiB: psutil", False, True)
    verifier, drafter = report["roles"]
    assert (verifier["share"], drafter["share"]) == (int(48 * GIB * 0.72), int(48 * GIB * 0.18))
    cfg = load_config(config)
    taps = load_drafter(cfg.model.draft_model_path).cfg.target_layer_ids
    assert verifier["need"] == Verifier.static_bytes(load_checkpoint(cfg.model.target_model_path), verifier["slots"],
                                                     verifier["max_len"], taps, torch.float32, False)
    assert drafter["need"] < plan_capacity(cfg, 48 * GIB).roles[1].need  # a GPU's captured drafter: a spare slot
    assert main(["plan", "--config", config]) == 0
    table = capsys.readouterr().out
    assert "; RAM 48.0 GiB (available now, of 64.0 GiB: psutil), gpu_memory_utilization 0.9" in table
    assert "| verifier | " in table and "Every role fits." in table

    ram["available"] = 2**28  # 256 MiB: the verifier's 16 slots do not fit its share
    assert main(["plan", "--config", config]) == 1
    assert "verifier: needs 0.23 GiB of its 0.18 GiB share; lower to server.max_batch" in capsys.readouterr().out
    assert main(["plan", "--config", config, "--gpu-memory", "80GB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["device"], report["memory_bytes"], report["graphs"]) == ("cuda", 80 * 10**9, True)


def test_a_gpu_config_without_a_gpu_must_name_the_card(reference_pairs, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: plan reads its memory")
    assert main(["plan", "--config", str(write_config(tmp_path, *reference_pairs["27b"]))]) == 2
    assert "--gpu-memory: this machine has no GPU" in capsys.readouterr().err


def test_two_ranks_on_40_gb_cards_plan_rank_0s_part(reference_pairs, tmp_path, capsys):
    """model.tensor_parallel_size 2 on 40 GB cards: the verifier's row is rank 0's part - half the layers' weights
    with the embedding and LM head whole, half of each slot's KV cache or states with the tap features whole - and
    what it names to lower is rank 0's."""
    for size in ("27b", "27b-hybrid"):
        target, drafter = reference_pairs[size]
        one = plan_capacity(load_config(write_config(tmp_path, target, drafter)), 80 * 10**9).roles[0]
        cfg = load_config(write_config(tmp_path, target, drafter, tensor_parallel_size=2))
        two = plan_capacity(cfg, 40 * 10**9).roles[0]
        assert two.role == "verifier (rank 0 of 2)" and one.weights / 2 < two.weights < one.weights * 0.6
        assert one.per_slot / 2 < two.per_slot < one.per_slot * 0.6  # the taps stay whole on rank 0
        assert not two.fits and two.share < two.need
    assert main(["plan", "--config", str(write_config(tmp_path, *reference_pairs["27b"], tensor_parallel_size=2)),
                 "--gpu-memory", "40GB"]) == 1
    assert "| verifier (rank 0 of 2) | 26.34 |" in capsys.readouterr().out
