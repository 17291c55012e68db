"""`blockspec plan`: the start-up checks' arithmetic from the configs alone - the shipped pair, a 27B dense target and a
Qwen3.5-27B-shaped hybrid with a DFlash drafter shaped as the published 27B one, on 80 GB and 141 GB cards: the split
from need, the KV tokens that fit, requests at once at an average length, the longest context."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from blockspec.common.config import MIN_MODEL_LEN as MIN_LEN
from blockspec.common.config import load_config
from blockspec.common.runtime.device import DRAFTER_MARGIN, DRAFTER_SLACK
from blockspec.common.runtime.footprint import STEP_RESERVE
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
    for size in ("27b", "27b-hybrid"):  # the hybrid with Qwen3.5-27B's own context
        raw = {**hf_config(size), "max_position_embeddings": 32768 if size == "27b" else 262144}
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
    """The verifier's need equals `Verifier.static_bytes` of the loaded target with the plan's KV blocks (the start-up
    check's figure, weights counted from the tensors), the drafter's what its role claims before it loads."""
    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.drafter import service
    from blockspec.services.drafter.dflash.checkpoint import load_drafter
    from blockspec.services.verifier.verifier import Verifier

    cfg = load_config(ROOT / "deploy" / "config.yaml")
    plan = plan_capacity(cfg, 80 * 10**9)
    assert plan.fits and plan.method == "dflash" and plan.graphs and plan.verifier.kv_from == "share"
    verifier, drafter = plan.verifier, plan.drafter
    target = load_checkpoint(cfg.model.target_model_path)
    taps = load_drafter(cfg.model.draft_model_path).cfg.target_layer_ids
    assert verifier.need == Verifier.static_bytes(target, verifier.slots, verifier.max_len, taps, torch.float32, True,
                                                  num_blocks=verifier.num_blocks) + STEP_RESERVE
    block = verifier.block_size * (verifier.kv_token + verifier.tap_token)
    assert verifier.need <= verifier.share < verifier.need + block
    claimed = []
    monkeypatch.setattr(service, "claim_gpu_share", lambda device, fraction, need, role: claimed.append(need))
    service._claim_share("dflash", None, load_drafter(cfg.model.draft_model_path), verifier.slots, verifier.max_len,
                         torch.device("cuda"), torch.float32, 0.1)
    assert claimed == [drafter.need]


def bound(plan, length: int) -> float:
    """Requests of `length` tokens at once, by hand from the plan's inputs: what the verifier's share leaves beside its
    weights, buffers and the step's reserve, over a request's slot state, K/V and tap features."""
    v = plan.verifier
    return (v.share - v.weights - v.buffers - STEP_RESERVE) / (v.slot + length * (v.kv_token + v.tap_token))


@pytest.mark.parametrize("size", ["27b", "27b-hybrid"])
def test_27b_pairs_on_80_gb_hold_requests_within_5_percent_of_the_arithmetic(size, reference_pairs, tmp_path, capsys):
    """16 slots of 4096 tokens on an 80 GB card: the drafter's share is what it holds (weights, a slot of max_model_len
    for each request and a spare) with the margin, the verifier's KV cache what the rest leaves; the requests it holds
    at once at 4k and 2k are within 5% of the arithmetic bound (not the two or three slots of a whole max_model_len
    each that a fixed 80/20 split of slots gave); with server.max_batch set to them (the drafter's cache, the slots'
    states and the captured steps' buffers counted at that many) they are the arithmetic's whole requests."""
    target, drafter = reference_pairs[size]
    config = write_config(tmp_path, target, drafter)
    plan = plan_capacity(load_config(config), 80 * 10**9, lengths=(4096, 2048))
    v, d = plan.verifier, plan.drafter
    total = 80 * 10**9
    # the per-token bytes from the shapes: K and V of each attention layer, and three tap layers' hidden states
    layers, kv_heads, head_dim = (64, 8, 128) if size == "27b" else (16, 4, 256)
    assert (v.kv_token, v.tap_token) == (2 * layers * kv_heads * head_dim * 2, 3 * 5120 * 2)
    drafter_kv = 2 * 5 * kv_heads * head_dim * 2 * 4096 * 17  # 5 layers, 16 slots and a spare
    assert d.kv == drafter_kv and d.need == d.weights + drafter_kv
    assert d.fraction == math.ceil((d.need * (1 + DRAFTER_MARGIN) + DRAFTER_SLACK) / total * 1e4) / 1e4
    assert v.share == int(total * round(0.9 - d.fraction, 4)) and 49 * GIB < v.weights < 51 * GIB
    assert v.kv_tokens == (v.share - v.fixed) // (16 * (v.kv_token + v.tap_token)) * 16 and plan.fits
    at_4k, at_2k = plan.concurrency
    for c in plan.concurrency:  # at max_batch 16: the blocks left beside 16 slots' states
        assert c.at_max_batch == min(16, v.kv_tokens // c.length)
    if size == "27b":  # no per-slot state: the same bound
        assert at_4k.at_max_batch == int(bound(plan, 4096))
    assert main(["plan", "--config", str(config), "--gpu-memory", "80GB", "--avg-len", "4096",
                 "--avg-len", "2048"]) == 0
    out = capsys.readouterr().out
    assert f"its KV cache (what its share leaves): {v.num_blocks} blocks = {v.kv_tokens} tokens" in out
    assert f"| 4096 | {at_4k.at_max_batch} | {at_4k.best} |" in out and "Every role fits." in out
    assert at_2k.at_max_batch == 16 < at_2k.best  # max_batch caps it: the best column raises it
    for c in plan.concurrency:  # with max_batch set to them: the drafter's cache, states and buffers at that many
        best = load_config(write_config(tmp_path, target, drafter, max_batch=c.best))
        at_best = plan_capacity(best, total, lengths=(c.length,))
        assert c.best == int(bound(at_best, c.length))  # the arithmetic's whole requests: within 5%, exactly
        over = plan_capacity(load_config(write_config(tmp_path, target, drafter, max_batch=c.best + 1)), total,
                             lengths=(c.length,))
        assert bound(over, c.length) < c.best + 1  # one more slot: not one more request
    assert (at_4k.at_max_batch, at_4k.best, at_2k.best) == ((9, 9, 17) if size == "27b" else (11, 14, 17))


def test_the_drafters_share_can_be_set(reference_pairs, tmp_path, capsys):
    """model.drafter_memory_fraction replaces the share from need: the verifier gets the rest; one too small for what
    the drafter holds fails the plan, naming the key and what it holds."""
    target, drafter = reference_pairs["27b"]
    from_need = plan_capacity(load_config(write_config(tmp_path, target, drafter)), 80 * 10**9)
    cfg = load_config(write_config(tmp_path, target, drafter, drafter_memory_fraction=0.12))
    plan = plan_capacity(cfg, 80 * 10**9)
    assert plan.fits and (plan.drafter.fraction, plan.verifier.fraction) == (0.12, 0.78) and plan.drafter.fixed
    assert plan.verifier.kv_tokens < from_need.verifier.kv_tokens
    assert main(["plan", "--config", str(write_config(tmp_path, target, drafter, drafter_memory_fraction=0.05)),
                 "--gpu-memory", "80GB"]) == 1
    assert "drafter: needs 5.41 GiB of its 3.73 GiB share (model.drafter_memory_fraction 0.05); raise it" in (
        capsys.readouterr().out)
    with pytest.raises(Exception, match="model.drafter_memory_fraction: 0.9 leaves the verifier nothing"):
        plan_capacity(load_config(write_config(tmp_path, target, drafter, drafter_memory_fraction=0.9)), 80 * 10**9)


def test_qwen35s_native_context_fits_where_one_request_does(reference_pairs, tmp_path, capsys):
    """max_model_len 262,144 (the hybrid's own): the verdict is one request of it in the verifier's KV blocks. On a
    141 GB card at max_batch 4 it fits; on an 80 GB card even at max_batch 1 it does not, and the plan says how many
    tokens do and the max_model_len that fits."""
    target, drafter = reference_pairs["27b-hybrid"]
    config = write_config(tmp_path, target, drafter, max_batch=4, max_model_len=262144)
    plan = plan_capacity(load_config(config), 141 * 10**9)
    assert plan.fits and plan.verifier.kv_tokens >= 262144 and plan.verifier.longest == 262144
    config = write_config(tmp_path, target, drafter, max_batch=1, max_model_len=262144)
    assert main(["plan", "--config", str(config), "--gpu-memory", "80GB", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    v = report["verifier"]
    assert not report["fits"] and 0 < v["kv_tokens"] < 262144 and MIN_LEN < v["longest"] < 262144
    assert f"its {v['share'] / GIB:.2f} GiB share holds {v['kv_tokens']} tokens; lower to model.max_model_len " \
           f"{v['longest']} (at max_batch 1)" in report["advice"][0]
    longest = plan_capacity(load_config(write_config(tmp_path, target, drafter, max_batch=1,
                                                     max_model_len=v["longest"])), 80 * 10**9)
    assert longest.fits  # the advice, taken


def test_a_cpu_config_is_planned_in_the_ram_available(monkeypatch, capsys):
    """`plan` on a CPU config (the shipped one) answers without --gpu-memory: the RAM psutil says is available, the
    CPU runner's count (no spare slot, no captured steps, a KV cache of max_batch requests of max_model_len:
    `Verifier.static_bytes` with graphs off), split as a GPU is. Too little RAM is exit code 1 with what to lower;
    --gpu-memory still plans as on a GPU of that size."""
    import psutil

    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.common.runtime.device import drafter_fraction
    from blockspec.services.drafter.dflash.checkpoint import load_drafter
    from blockspec.services.verifier.verifier import Verifier

    config = str(ROOT / "deploy" / "config.yaml")
    ram = {"total": 64 * GIB, "available": 48 * GIB}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Ram", (), ram)())
    assert main(["plan", "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["device"], report["memory_bytes"], report["memory"], report["graphs"], report["fits"]) == (
        "cpu", 48 * GIB, "available now, of 64.0 GiB: psutil", False, True)
    verifier, drafter = report["verifier"], report["drafter"]
    assert drafter["fraction"] == drafter_fraction(drafter["need"], 48 * GIB)
    assert verifier["share"] == int(48 * GIB * round(0.9 - drafter["fraction"], 4)) and verifier["kv_from"] == "slots"
    cfg = load_config(config)
    taps = load_drafter(cfg.model.draft_model_path).cfg.target_layer_ids
    assert verifier["need"] == Verifier.static_bytes(load_checkpoint(cfg.model.target_model_path), verifier["slots"],
                                                     verifier["max_len"], taps, torch.float32, False) + STEP_RESERVE
    assert drafter["need"] < plan_capacity(cfg, 48 * GIB).drafter.need  # a GPU's captured drafter: a spare slot
    assert main(["plan", "--config", config]) == 0
    table = capsys.readouterr().out
    assert "; RAM 48.0 GiB (available now, of 64.0 GiB: psutil), gpu_memory_utilization 0.9" in table
    assert f"its KV cache (16 requests of {verifier['max_len']})" in table and "Every role fits." in table

    ram["available"] = 2**28  # 256 MiB: the drafter's margin alone takes the verifier's part
    assert main(["plan", "--config", config]) == 1
    assert "verifier: no KV cache fits" in capsys.readouterr().out
    ram["available"] = 2**30  # 1 GiB: the 16 slots' KV cache does not fit, fewer do
    assert main(["plan", "--config", config]) == 1
    assert "lower to model.max_model_len" in capsys.readouterr().out
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
    with the embedding and LM head whole, half of each token's K/V or of a slot's states with the tap features
    whole - and its ranks keep a slot of max_model_len a request (not sized from the share)."""
    for size in ("27b", "27b-hybrid"):
        target, drafter = reference_pairs[size]
        one = plan_capacity(load_config(write_config(tmp_path, target, drafter)), 80 * 10**9).verifier
        cfg = load_config(write_config(tmp_path, target, drafter, tensor_parallel_size=2))
        two = plan_capacity(cfg, 40 * 10**9).verifier
        assert two.role == "verifier (rank 0 of 2)" and one.weights / 2 < two.weights < one.weights * 0.6
        assert (two.tap_token, two.slot) == (one.tap_token, one.slot // 2) and two.kv_token == one.kv_token // 2
        assert two.kv_from == "ranks" and two.num_blocks == 16 * 4096 // 16 and not two.fits and two.share < two.need
    assert main(["plan", "--config", str(write_config(tmp_path, *reference_pairs["27b"], tensor_parallel_size=2)),
                 "--gpu-memory", "40GB"]) == 1
    assert "Verifier (rank 0 of 2): " in capsys.readouterr().out
