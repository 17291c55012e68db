"""Tensor parallelism on the CPU (gloo, two ranks; common/runtime/tensor_parallel.py): speculative output equals plain
decoding at the same tensor_parallel_size, one prompt and batched, every method; and a rank killed mid-stream ends
its replica's requests UNAVAILABLE while the other replica serves and the lost one comes back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest
import torch

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.tensor_parallel import shard_config, unsupported
from blockspec.protos import api_pb2
from blockspec.services.training.tiny import build_tiny_family
from tests.helpers import CONFIG, spawn_serve, stop_serve, wait_for

NEW = 24
# One process per run: the calling process leads the ranks (torch.distributed's group is per process).
SCRIPT = """
import json, sys
from blockspec.services.engine.engine import Engine
target, drafter, method, world, prompts = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
device, ks, backend = sys.argv[6], [int(k) for k in sys.argv[7].split(",")], sys.argv[8]
e = Engine(target, drafter, method, max_batch=4, tensor_parallel_size=world, device=device,
           threads=1 if device == "cpu" else None, backend=backend)
print(type(e.verifier.runner).__name__, file=sys.stderr)
out = {}
for k in ks:
    alone = list(e.complete([e.request(f"a{k}", prompts[0], NEW, k)])[0].token_ids)
    batched = [list(f.token_ids) for f in e.complete([e.request(f"b{i}-{k}", p, NEW, k) for i, p in enumerate(prompts)])]
    out[k] = {"alone": alone, "batched": batched}
print(json.dumps(out))
""".replace("NEW", str(NEW))


def run(target, drafter, method: str, world: int, prompts, device: str = "cpu", ks=(0, 3), backend: str = "auto"
        ) -> dict:
    """Greedy streams of `prompts` (each alone and all batched) at each k of ks, in a process that leads `world`
    ranks (backend "graphs": the CUDA runner's step on every rank, uncaptured on the CPU)."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(target), str(drafter or ""), method, str(world),
                           json.dumps(prompts), device, ",".join(map(str, ks)), backend], capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if backend == "graphs" and world > 1:
        assert "CudaLeadRunner" in proc.stderr
    return {int(k): v for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize(("family", "method"), [("qwen3", "dflash"), ("qwen2", "draft_model"), ("llama", "ngram")])
def test_two_ranks_speculative_equals_plain_at_the_same_size(tiny_models, dflash_drafters, prompts, family, method):
    drafter = {"dflash": dflash_drafters.get(f"{family}-trained"), "draft_model": tiny_models[family]["other"],
               "ngram": None}[method]
    chosen = [p[:40] for p in prompts[:3]]
    out = run(tiny_models[family]["target"], drafter, method, 2, chosen)
    assert out[3]["batched"] == out[0]["batched"]  # speculative == plain at tensor_parallel_size 2
    assert out[3]["alone"] == out[0]["alone"] == out[0]["batched"][0]  # one prompt alone == the same in a batch
    one = run(tiny_models[family]["target"], None, "ngram", 1, chosen)[0]["batched"]
    same = sum(a == b for x, y in zip(out[0]["batched"], one) for a, b in zip(x, y))
    print(f"{family}: tensor_parallel_size 2 agrees with 1 on {same} of {sum(map(len, one))} tokens")


@pytest.fixture(scope="module")
def split_families(tmp_path_factory, tokenizer) -> dict:
    root = tmp_path_factory.mktemp("tp-families")
    return {name: build_tiny_family(root / name, *name.split("-"), tokenizer=tokenizer)
            for name in ("qwen3_5-text", "qwen3_5-multimodal", "qwen3_5_moe-text", "qwen3_moe-text")}


@pytest.mark.parametrize("name", ["qwen3_5-text", "qwen3_5-multimodal", "qwen3_5_moe-text", "qwen3_moe-text"])
def test_two_ranks_of_a_hybrid_or_moe_target_speculative_equals_plain(split_families, prompts, name):
    """A Qwen3.5 hybrid (its Gated DeltaNet layers split by heads, their states per rank; both layouts), a Qwen3.5-MoE
    and a Qwen3-MoE (each expert and the shared expert split by width, the router whole): at 2 ranks n-gram speculation
    at k 1, 5 and 15 equals plain decoding, each prompt alone and batched; agreement with 1 rank printed."""
    chosen = [p[:40] for p in prompts[:3]]
    out = run(split_families[name], None, "ngram", 2, chosen, ks=(0, 1, 5, 15))
    for k in (1, 5, 15):
        assert out[k]["batched"] == out[0]["batched"] and out[k]["alone"] == out[0]["alone"], k
    assert out[0]["alone"] == out[0]["batched"][0]
    if name == "qwen3_5-text":
        one = run(split_families[name], None, "ngram", 1, chosen, ks=(0,))[0]["batched"]
        same = sum(a == b for x, y in zip(out[0]["batched"], one) for a, b in zip(x, y))
        print(f"{name}: tensor_parallel_size 2 agrees with 1 on {same} of {sum(map(len, one))} tokens")


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5-text", "qwen3_5_moe-text"])
def test_the_cuda_runners_step_split_over_two_ranks_stays_exact(split_families, tiny_models, prompts, name):
    """The CUDA runner under tensor parallelism, its step run uncaptured on the CPU over gloo: each rank's shard
    merged into the step, the sums over the ranks inside it (after the attention's and the Gated DeltaNet's output
    products and the MLP or the experts), the embedding and LM head over vocabulary ranges. n-gram speculation at k 1
    and 5 equals plain decoding at 2 ranks, each prompt alone and batched."""
    target = tiny_models["qwen3"]["target"] if name == "qwen3" else split_families[name]
    chosen = [p[:40] for p in prompts[:3]]
    out = run(target, None, "ngram", 2, chosen, ks=(0, 1, 5), backend="graphs")
    for k in (1, 5):
        assert out[k]["batched"] == out[0]["batched"] and out[k]["alone"] == out[0]["alone"], k
    assert out[0]["alone"] == out[0]["batched"][0]


def test_each_rank_takes_its_own_gpu(monkeypatch):
    """The CUDA start-up without a GPU: rank r of a lead on cuda (or cuda:0) takes GPU r, of a lead on cuda:2 GPU
    2 + r; joining names an indexed device (torch's set_device refuses a bare "cuda"); a follower is told the lead's
    device as it was named."""
    from blockspec.common.runtime import tensor_parallel as tp
    from blockspec.common.runtime import tp_ranks

    assert [tp.rank_device("cuda", r) for r in (0, 1)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert tp.rank_device("cuda:2", 1) == torch.device("cuda", 3) and tp.rank_device("cpu", 1) == torch.device("cpu")
    made, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    monkeypatch.setattr(tp.dist, "init_process_group", lambda backend, **kw: joined.append((backend, kw["rank"])))
    tp.init(1, 2, "127.0.0.1:1", tp.rank_device("cuda", 1))
    assert made == [torch.device("cuda", 1)] and joined == [("nccl", 1)]
    with pytest.raises(ValueError, match="rank 0: cuda names no GPU index"):
        tp.init(0, 2, "127.0.0.1:1", torch.device("cuda"))
    started = []
    monkeypatch.setattr(tp_ranks.subprocess, "Popen", lambda argv: started.append(json.loads(argv[-1])))
    monkeypatch.setattr(tp_ranks, "_followers", [])
    tp_ranks.start_followers(3, "target", 2, 64, None, torch.bfloat16, torch.device("cuda", 2), graphs=True)
    assert [(a[0], a[8], a[11]) for a in started] == [(1, "cuda:2", True), (2, "cuda:2", True)]  # rank_device(cuda:2, r)


def test_followers_keep_the_leads_block_tables():
    """Requests taken, grown, released and taken again on the lead, with a pool smaller than every slot's max_len:
    after each step's message a follower's tables are the lead's, block for block, its own pool never used."""
    from blockspec.common.models.kv_cache import PagedKVCache
    from blockspec.common.runtime.tp_ranks import Leads

    lead, follower = (PagedKVCache(1, 3, 1, 128, 4, num_blocks=12, block_size=8) for _ in range(2))
    sender = Leads()
    sender.cache = lead
    a, b = lead.allocate(), lead.allocate()
    for slot, end in ((a, 20), (b, 9), (a, 33), (b, 30)):  # grown side by side: interleaved blocks
        lead.reserve(slot, end)
        follower.follow(slot, *sender._blocks_news(slot))
    lead.release(a)
    c = lead.allocate()
    assert c == a  # the slot again, which the followers were sent other blocks for
    for slot, end in ((c, 17), (b, 31), (c, 40)):  # c takes a's blocks back, in another order
        lead.reserve(slot, end)
        keep, blocks = sender._blocks_news(slot)
        follower.follow(slot, keep, blocks)
        assert sender._blocks_news(slot) == (len(lead.held[slot]), ())  # nothing new until the slot's blocks change
    for slot in (b, c):
        assert follower.held[slot] == lead.held[slot]
        assert torch.equal(follower.table[slot, : len(lead.held[slot])], lead.table[slot, : len(lead.held[slot])])
    assert follower.pool.free == 12


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL between them); the device "
                                                           "machines lent here have one")
def test_on_two_gpus_speculative_equals_plain_at_the_same_size(tiny_models, prompts):
    chosen = [p[:40] for p in prompts[:3]]
    out = run(tiny_models["qwen3"]["target"], tiny_models["qwen3"]["other"], "draft_model", 2, chosen, "cuda")
    assert out[3]["batched"] == out[0]["batched"] and out[3]["alone"] == out[0]["batched"][0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices: on Ray a replica's placement group "
                                                           "holds a GPU per rank; the device machines lent here have one")
def test_on_ray_a_replica_takes_a_gpu_per_rank_and_stays_exact(tiny_models, dflash_drafters, tmp_path, prompts):
    cfg = tmp_path / "tp-ray.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("tensor_parallel_size: 1", "tensor_parallel_size: 2").replace('device: "cpu"', 'device: "cuda"'))
    info = spawn_serve("--config", str(cfg))
    try:
        for i in range(3):
            tokens = [[t for m in info["stub"].Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=64, **k), timeout=120) for t in m.token_ids]
                for k in ({}, {"num_speculative_tokens": 0})]
            assert tokens[0] == tokens[1]
    finally:
        stop_serve(info)


def test_what_does_not_split_is_named(tiny_models, split_families, tmp_path):
    cfg = load_checkpoint(tiny_models["qwen3"]["target"], with_weights=False).config
    assert unsupported(cfg, 1) is None and unsupported(cfg, 2) is None
    assert "num_attention_heads 4 does not divide by 3" in unsupported(cfg, 3)
    part = shard_config(cfg, 2)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (2, 1, cfg.intermediate_size // 2)
    hybrid = load_checkpoint(split_families["qwen3_5_moe-text"], with_weights=False).config
    assert unsupported(hybrid, 2) is None
    part = shard_config(hybrid, 2)
    assert (part.linear.num_k_heads, part.linear.num_v_heads) == (hybrid.linear.num_k_heads // 2,
                                                                  hybrid.linear.num_v_heads // 2)
    assert part.experts.intermediate_size == hybrid.experts.intermediate_size // 2
    assert "does not divide by 5" in unsupported(hybrid, 5)
    bad = tmp_path / "tp3.yaml"
    bad.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=tiny_models["qwen3"]["other"])
                   .replace("tensor_parallel_size: 1", "tensor_parallel_size: 3"))
    proc = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "serve", "--config", str(bad), "--no-ray"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "model.tensor_parallel_size: 3: its num_attention_heads 4" in proc.stderr


def follower_pids(proc: subprocess.Popen) -> list[int]:
    return [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
            if "blockspec.common.runtime.tp_ranks" in " ".join(p.cmdline())]


@pytest.mark.slow  # two replicas of two ranks and a drafter each, one replaced: about a minute
def test_a_rank_killed_mid_stream_ends_its_requests_unavailable_and_the_replica_comes_back(
        tiny_models, dflash_drafters, tmp_path, prompts):
    cfg = tmp_path / "tp.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("tensor_parallel_size: 1", "tensor_parallel_size: 2")
                   .replace("  max_batch: 4\n", "  max_batch: 2\n  replicas: 2\n"))
    info = spawn_serve("--config", str(cfg), "--no-ray")
    try:
        stub = info["stub"]
        assert len(follower_pids(info["proc"])) == 2
        long = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[0]), max_tokens=400,
                                       num_speculative_tokens=0)
        streams = [stub.Generate(long, timeout=120) for _ in range(4)]  # two on each replica
        for s in streams:
            next(s)
        os.kill(follower_pids(info["proc"])[0], signal.SIGKILL)
        codes = []
        for s in streams:
            try:
                list(s)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
        assert "UNAVAILABLE" in codes and "OK" in codes, codes  # the lost replica's, and the other one's
        assert wait_for(lambda: len(follower_pids(info["proc"])) == 2, 120)  # the replica again, both ranks
        time.sleep(1)
        for i in range(3):  # speculative == plain decoding, at tensor_parallel_size 2
            tokens = [[t for m in stub.Generate(api_pb2.GenerateRequest(
                token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=64, **k), timeout=120) for t in m.token_ids]
                for k in ({}, {"num_speculative_tokens": 0})]
            assert tokens[0] == tokens[1]
    finally:
        stop_serve(info)
