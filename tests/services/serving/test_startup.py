"""Device and dtype: `--device` / `--dtype` and the config's model.device / model.dtype reach both roles,
and every wrong value is refused with the flag or key named (the GPU runs themselves need a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from blockspec.common.config import parse_config
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.common.runtime.device import resolve
from blockspec.services.serving.role_args import parse_role_args
from blockspec.services.serving.startup import resolve_startup


def test_resolve_names_the_flag_at_fault():
    assert resolve("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    for device, dtype, message in [("tpu", "float32", "--device: 'tpu' is not a device"),
                                   ("cpu:1", "float32", "--device: 'cpu:1' is not a device"),
                                   ("cpu", "int8", "--dtype: 'int8' is not supported; choose one of float32, bfloat16, float16")]:
        with pytest.raises(InvalidArgument, match=message):
            resolve(device, dtype)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="model.device: 'cuda:0': CUDA is not available"):
            resolve("cuda:0", device_field="model.device")


def config(tiny_models, dflash_drafters, **model) -> object:
    return parse_config({"model": {"target_model_path": str(tiny_models["qwen3"]["target"]),
                                   "draft_model_path": str(dflash_drafters["qwen3-trained"]), **model}})


def test_the_plan_gives_both_roles_the_configured_device_and_dtype(tiny_models, dflash_drafters):
    p = resolve_startup(config(tiny_models, dflash_drafters, device="cuda", dtype="bfloat16"))
    for argv in (p.verifier_argv, p.drafter_argv):
        args = parse_role_args(list(argv))
        assert (args.device, args.dtype) == ("cuda", "bfloat16")
    args = parse_role_args(list(resolve_startup(config(tiny_models, dflash_drafters)).verifier_argv))
    assert (args.device, args.dtype, args.invariant) == ("cpu", "float32", False)  # the defaults


def test_model_invariant_makes_the_verifier_role_decode_at_the_verify_width(tiny_models, dflash_drafters):
    """model.invariant (what bf16 on a GPU needs to stay token-identical) reaches the verifier role only."""
    from blockspec.services.serving.launch import role_service

    p = resolve_startup(config(tiny_models, dflash_drafters, invariant=True, dtype="bfloat16"))
    assert "--invariant" in p.verifier_argv and "--invariant" not in p.drafter_argv
    service = role_service(parse_role_args(list(p.verifier_argv)))
    runner = service.verifier.runner
    assert runner.query_width == 8 and runner.model.embed_tokens.weight.dtype == torch.bfloat16  # k <= 7: 8 rows


def test_model_runner_picks_the_verifier_roles_runner(tiny_models, dflash_drafters):
    """model.runner reaches the verifier role only; `graphs` builds the CUDA runner (its code, uncaptured on the CPU),
    `auto` the eager one on the CPU, and a value outside the three is refused naming the key."""
    from blockspec.common.runtime.cuda_runner import CudaRunner
    from blockspec.common.runtime.runner import Runner
    from blockspec.services.serving.launch import role_service

    p = resolve_startup(config(tiny_models, dflash_drafters, runner="graphs"))
    argv = list(p.verifier_argv)
    assert argv[argv.index("--runner") + 1] == "graphs"
    assert "--runner" not in p.drafter_argv
    assert isinstance(role_service(parse_role_args(list(p.verifier_argv))).verifier.runner, CudaRunner)
    p = resolve_startup(config(tiny_models, dflash_drafters))
    assert "--runner" not in p.verifier_argv
    assert type(role_service(parse_role_args(list(p.verifier_argv))).verifier.runner) is Runner
    with pytest.raises(InvalidArgument, match="model.runner"):
        config(tiny_models, dflash_drafters, runner="fast")


def test_longer_lookup_drafts_are_refused_in_invariant_mode_and_with_adaptive_k(tiny_models, dflash_drafters):
    cfg = config(tiny_models, dflash_drafters, invariant=True,
                 spec_decode={"prompt_lookup": True, "prompt_lookup_tokens": 16})
    with pytest.raises(InvalidArgument, match="prompt_lookup_tokens: 16 is not allowed with model.invariant"):
        resolve_startup(cfg)
    cfg = config(tiny_models, dflash_drafters, spec_decode={"prompt_lookup": True, "prompt_lookup_tokens": 16,
                                                            "adaptive_k": True})
    with pytest.raises(InvalidArgument, match="16 is not allowed with model.spec_decode.adaptive_k: true"):
        resolve_startup(cfg)
    assert resolve_startup(config(tiny_models, dflash_drafters, spec_decode={"prompt_lookup": True, "prompt_lookup_tokens": 16}))
    with pytest.raises(InvalidArgument, match="16 is not allowed without model.spec_decode.prompt_lookup: true"):
        resolve_startup(config(tiny_models, dflash_drafters, spec_decode={"prompt_lookup_tokens": 16}))  # it would be ignored


def test_a_drafter_the_roles_would_refuse_is_refused_by_the_plan(tiny_models, dflash_drafters):
    """Checked before any role starts, naming the key (before: a verifier traceback, or both roles started and a
    k past the drafter's block refused 15 s later with cancelled-stream tracebacks in their logs)."""
    def refused(**model) -> str:
        with pytest.raises(InvalidArgument) as e:
            resolve_startup(parse_config({"model": {"target_model_path": str(tiny_models["qwen3"]["target"]), **model}}))
        return str(e.value)

    other_family = str(tiny_models["llama"]["other"])  # 1 layer: the qwen3 drafter taps 2
    message = refused(target_model_path=other_family, draft_model_path=str(dflash_drafters["qwen3-trained"]))
    assert message.startswith("model.draft_model_path: ") and "drafter does not fit the target" in message
    message = refused(draft_model_path=str(tiny_models["qwen3"]["other"]), spec_decode={"method": "dflash"})
    assert message.startswith("model.draft_model_path: ") and "not a DFlash drafter checkpoint" in message
    message = refused(draft_model_path=str(dflash_drafters["qwen3-trained"]), spec_decode={"num_speculative_tokens": 16})
    assert message.startswith("model.spec_decode.num_speculative_tokens: 16 is not allowed: the dflash drafter supports 1..")


def test_each_role_gets_its_memory_share_from_need_and_is_refused_when_it_does_not_fit(tiny_models, dflash_drafters):
    """model.gpu_memory_utilization splits one GPU between the roles: the drafter's share is what it holds (its
    weights, a slot of max_model_len for each of server.max_batch requests and a spare, as its start-up check counts)
    with a margin, or model.drafter_memory_fraction; the verifier's the rest. Both roles' command lines carry the
    split and resolve it on the GPU they find; a role whose memory exceeds its share is refused at start with the
    key, the sizes and what to change."""
    from blockspec.common.models.kv_cache import SlotKVCache
    from blockspec.common.runtime.device import DRAFTER_MARGIN, DRAFTER_SLACK, MemorySplit, check_fits, claim_gpu_share
    from blockspec.services.drafter.dflash.checkpoint import load_drafter

    p = resolve_startup(config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.5))
    splits = [MemorySplit.from_args(parse_role_args(list(argv))) for argv in (p.verifier_argv, p.drafter_argv)]
    drafter = load_drafter(dflash_drafters["qwen3-trained"])
    cfg = drafter.cfg
    max_len = load_checkpoint(tiny_models["qwen3"]["target"], with_weights=False).config.max_position_embeddings
    need = (sum(t.numel() for t in drafter.parameters()) * 4
            + SlotKVCache.nbytes(cfg.num_layers, 16 + 1, cfg.num_kv_heads, min(max_len, 4096), cfg.head_dim))
    assert splits == [p.memory, p.memory] == [MemorySplit(0.5, need)] * 2
    gib = 2**30
    drafter_share = math.ceil((need * (1 + DRAFTER_MARGIN) + DRAFTER_SLACK) / (80 * gib) * 1e4) / 1e4
    assert p.memory.fractions(80 * gib) == (round(0.5 - drafter_share, 4), drafter_share)
    fixed = resolve_startup(config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.5,
                                   drafter_memory_fraction=0.1))
    args = parse_role_args(list(fixed.verifier_argv))
    assert (args.drafter_memory_fraction, args.drafter_memory) == (0.1, None)
    assert MemorySplit.from_args(args).fractions(80 * gib) == (0.4, 0.1)
    with pytest.raises(InvalidArgument, match="model.drafter_memory_fraction: 0.5 leaves the verifier nothing"):
        resolve_startup(config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.5,
                               drafter_memory_fraction=0.5))
    with pytest.raises(InvalidArgument, match=r"model.gpu_memory_utilization: the drafter's .* leaves the verifier "
                                              r"nothing of a replica's 0.5000"):
        MemorySplit(0.5, 60 * gib).fractions(80 * gib)
    assert "--gpu-memory-utilization" not in resolve_startup(config(tiny_models, dflash_drafters)).verifier_argv
    check_fits("verifier", 50 * gib, 141 * gib, 0.4)  # 56.4 GiB share: fits
    with pytest.raises(InvalidArgument, match=r"model.gpu_memory_utilization: the drafter role needs 20.00 GiB .* share is "
                                              r"0.100 of the GPU's 141.0 GiB = 14.10 GiB; raise gpu_memory_utilization"):
        check_fits("drafter", 20 * gib, 141 * gib, 0.1)
    claim_gpu_share(torch.device("cpu"), 0.1, 10**15, "verifier")  # the CPU: no share to check
    # A 27B-shaped KV cache for 16 requests of 4096 tokens in bf16 (64 layers, 8 KV heads of 128): 16 GiB.
    assert SlotKVCache.nbytes(64, 16, 8, 4096, 128, torch.bfloat16) == 16 * gib


def test_replicas_sharing_a_gpu_split_it_and_plain_decoding_gives_the_verifier_all(tiny_models, dflash_drafters):
    """--no-ray puts every replica on model.device: their parts add up to gpu_memory_utilization, not each to it.
    Without a drafter the verifier's share is the whole of a replica's part."""
    gib = 2**30
    cfg = config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.9)
    two = resolve_startup(cfg, replicas_per_gpu=2).memory
    assert two.utilization == 0.45 and sum(two.fractions(80 * gib)) == pytest.approx(0.45)
    plain = config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.9,
                   spec_decode={"enabled": False})
    assert resolve_startup(plain).memory.fractions(80 * gib) == (0.9, 0.0)
    assert resolve_startup(plain, replicas_per_gpu=3).memory.fractions(80 * gib) == (0.3, 0.0)


def test_the_verifiers_kv_cache_is_what_its_share_leaves_on_a_gpu(tiny_models):
    """On a GPU the verifier's KV blocks are what its share leaves beside its weights, states and buffers; a share
    that does not hold one request of max_len is refused naming model.max_model_len and the tokens it holds, and
    model.kv_cache_tokens past the share naming that key. On the CPU the blocks are max_batch requests of max_len."""
    from blockspec.common.runtime.device import kv_cache_blocks
    from blockspec.common.runtime.footprint import STEP_RESERVE
    from blockspec.services.verifier.verifier import Verifier

    checkpoint = load_checkpoint(tiny_models["qwen3"]["target"])
    layout = Verifier.layout(checkpoint, 4, (0, 1), torch.bfloat16, graphs=True)
    total = 2**30
    share = layout.held(100) + STEP_RESERVE + layout.block - 1  # 100 blocks and not quite one more, and the reserve
    fraction = share / total
    assert kv_cache_blocks(layout, 96, total, fraction) == layout.blocks_in(int(total * fraction)) in (99, 100)
    assert kv_cache_blocks(layout, 96) is None and kv_cache_blocks(layout, 96, kv_tokens=200) == 13  # the CPU
    with pytest.raises(InvalidArgument, match=r"model.max_model_len: the verifier's share.* KV blocks for 16.. "
                                              r"tokens; 2000 were asked \(max_model_len 2000\)"):
        kv_cache_blocks(layout, 2000, total, fraction)
    with pytest.raises(InvalidArgument, match=r"model.kv_cache_tokens: .*were asked \(max_model_len 96, "
                                              r"kv_cache_tokens 4000\)"):
        kv_cache_blocks(layout, 96, total, fraction, 4000)


def test_the_kv_cache_keys_reach_the_verifier_and_a_cpu_serve_keeps_its_default_memory(tiny_models, dflash_drafters):
    """On the CPU the verifier role and the in-process engine keep max_batch requests of max_model_len in blocks
    (nothing sized from a share); model.kv_cache_tokens, kv_block_size and prefix_caching reach both, and a
    kv_cache_tokens under one request of max_model_len is refused before any role starts."""
    from blockspec.services.serving.inprocess import build_engine
    from blockspec.services.serving.launch import role_service

    def verifier_of(**model):
        cfg = config(tiny_models, dflash_drafters, max_model_len=96, **model)
        p = resolve_startup(cfg, inprocess=True)
        assert p.memory is None and "--gpu-memory-utilization" not in p.verifier_argv
        role = role_service(parse_role_args(list(p.verifier_argv))).verifier
        engine = build_engine(cfg, p, "cpu", torch.float32).verifier
        return role, engine

    for v in verifier_of():
        assert (v.num_blocks, v.block_size, v.max_len, v.prefix_caching) == (16 * 6, 16, 96, True)
    for v in verifier_of(kv_cache_tokens=200, kv_block_size=32, prefix_caching=False):
        assert (v.num_blocks, v.block_size, v.max_len, v.prefix_caching) == (7, 32, 96, False)
    with pytest.raises(InvalidArgument, match="model.kv_cache_tokens: 64 is less than one request of max_model_len 96"):
        resolve_startup(config(tiny_models, dflash_drafters, max_model_len=96, kv_cache_tokens=64))
    with pytest.raises(InvalidArgument, match="model.kv_block_size: 24 is not allowed: a power of two"):
        config(tiny_models, dflash_drafters, kv_block_size=24)


def test_the_drafter_dtype_warning_is_for_a_dtype_the_operator_set(tiny_models, dflash_drafters, caplog):
    """spec_decode.draft_model_dtype defaults to bfloat16 and model.dtype to float32: a config that sets neither
    must not warn on every start; one that sets a differing draft_model_dtype is told it does not apply."""
    resolve_startup(config(tiny_models, dflash_drafters))
    assert "draft_model_dtype" not in caplog.text
    resolve_startup(config(tiny_models, dflash_drafters, spec_decode={"draft_model_dtype": "float16"}))
    assert "spec_decode.draft_model_dtype float16: the drafter runs in model.dtype, float32" in caplog.text


def test_the_verifiers_counted_bytes_are_what_it_allocates(tiny_models, dflash_drafters):
    """The share check counts the verifier before it exists: the count must equal what it then holds."""
    from blockspec.services.verifier.verifier import Verifier

    checkpoint = load_checkpoint(tiny_models["qwen3"]["target"])
    verifier = Verifier(checkpoint, 4, 96, tap_layers=(0, 1), dtype=torch.bfloat16)
    held = {id(t): t for t in (*verifier.runner.model.parameters(), verifier.runner.cache.k, verifier.runner.cache.v,
                               verifier.tap_buffer)}
    assert Verifier.static_bytes(checkpoint, 4, 96, (0, 1), torch.bfloat16) == sum(t.nbytes for t in held.values())
    # the CUDA runner (its code on the CPU): a spare block more, and what its graphs keep, counted apart
    verifier = Verifier(checkpoint, 4, 96, tap_layers=(0, 1), dtype=torch.bfloat16, backend="graphs")
    held = {t.data_ptr(): t for t in (*verifier.runner.model.parameters(), verifier.runner.cache.k,
                                      verifier.runner.cache.v, verifier.tap_buffer)}  # merged weights: one storage
    merged = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held.values()}
    outputs = verifier.runner.graph_bytes(checkpoint.config, 4, 96)
    tables = (1 + 2 + 4) * 96 // 16 * 8  # each batch size's block tables
    assert outputs == (1 + 2 + 4) * 31 * checkpoint.config.vocab_size * 4 + 7 * (2 + 3 + 5 + 9 + 17) * 8 + tables
    assert Verifier.static_bytes(checkpoint, 4, 96, (0, 1), torch.bfloat16, graphs=True) == sum(merged.values()) + outputs
    # a paged cache of another size: its blocks, K/V and tap features
    verifier = Verifier(checkpoint, 4, 96, tap_layers=(0, 1), dtype=torch.bfloat16, kv_blocks=10, block_size=32)
    held = {id(t): t for t in (*verifier.runner.model.parameters(), verifier.runner.cache.k, verifier.runner.cache.v,
                               verifier.tap_buffer)}
    assert Verifier.static_bytes(checkpoint, 4, 96, (0, 1), torch.bfloat16, block_size=32,
                                 num_blocks=10) == sum(t.nbytes for t in held.values())


def test_ray_asks_for_gpu_shares_that_fill_whole_gpus_and_refuses_a_gpu_index(tiny_models, dflash_drafters):
    from blockspec.services.serving.ray_placement import ray_gpus, serve_ray

    assert ray_gpus(config(tiny_models, dflash_drafters), True, 1) == (0.0, 0.0, 0.0)
    cuda = config(tiny_models, dflash_drafters, device="cuda", gpu_memory_utilization=0.9)
    assert ray_gpus(cuda, True, 1) == (1.0, 0.8, 0.2) and ray_gpus(cuda, False, 2) == (0.5, 0.5, 0.0)
    for per_gpu in (3, 6, 7):  # multiples of Ray's 1e-4 that add up to at most one GPU
        bundle, verifier, drafter = ray_gpus(cuda, True, per_gpu)
        assert verifier + drafter == pytest.approx(bundle) and bundle * per_gpu <= 1.0 and verifier > drafter > 0
    with pytest.raises(InvalidArgument, match="model.device: 'cuda:1': under Ray use 'cuda'"):
        serve_ray(config(tiny_models, dflash_drafters, device="cuda:1"), "127.0.0.1", 0, 0, None)


def replicas_config(tiny_models, dflash_drafters, replicas: int, **model) -> object:
    return parse_config({"model": {"target_model_path": str(tiny_models["qwen3"]["target"]),
                                   "draft_model_path": str(dflash_drafters["qwen3-trained"]), **model},
                         "server": {"replicas": replicas}})


def test_ray_shares_gpus_past_one_replica_each_and_refuses_what_the_cluster_cannot_hold(tiny_models, dflash_drafters):
    from blockspec.services.serving.ray_placement import replicas_per_gpu

    cuda = {"device": "cuda", "gpu_memory_utilization": 0.9}
    three = replicas_config(tiny_models, dflash_drafters, 3, **cuda)
    assert replicas_per_gpu(three, True, {"CPU": 16.0, "GPU": 4.0}) == 1
    assert replicas_per_gpu(three, True, {"CPU": 16.0, "GPU": 2.0}) == 2  # 2 + 1: the fuller GPU sets the share
    assert replicas_per_gpu(replicas_config(tiny_models, dflash_drafters, 3), True, {"CPU": 6.0}) == 1  # the CPU
    with pytest.raises(InvalidArgument, match="server.replicas: 3 replica.s. of 2 role.s. need 6 CPUs on Ray .one a "
                                              "role.; the cluster has 5"):
        replicas_per_gpu(three, True, {"CPU": 5.0, "GPU": 4.0})
    assert replicas_per_gpu(three, False, {"CPU": 5.0, "GPU": 4.0}) == 1  # plain decoding: one role a replica
    with pytest.raises(InvalidArgument, match="model.device: 'cuda', but the Ray cluster has no GPU"):
        replicas_per_gpu(three, True, {"CPU": 16.0})
    split = replicas_config(tiny_models, dflash_drafters, 2, tensor_parallel_size=2, **cuda)  # a GPU per rank
    assert replicas_per_gpu(split, True, {"CPU": 16.0, "GPU": 4.0}) == 1
    with pytest.raises(InvalidArgument, match="model.tensor_parallel_size: 2 ranks take a GPU each; the Ray cluster has 1"):
        replicas_per_gpu(split, True, {"CPU": 16.0, "GPU": 1.0})


def test_ray_places_each_replica_on_one_gpu_and_names_replicas_it_cannot_place(tiny_models, dflash_drafters):
    """A local Ray cluster that declares two GPUs (Ray counts them; nothing runs on them): three replicas, two
    on one GPU and one on the other, each replica's two roles on the same GPU (tasks with the roles' shares
    report Ray's GPU ids); then a fourth that needs a whole GPU, with CPUs to spare, fails within its timeout
    with the replica and the free resources named, and its group is removed."""
    ray = pytest.importorskip("ray")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from blockspec.services.serving.ray_placement import place_replicas, ray_gpus, replicas_per_gpu
    from blockspec.services.serving.serve import RoleStartError

    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        three = replicas_config(tiny_models, dflash_drafters, 3, device="cuda", gpu_memory_utilization=0.9)
        per_gpu = replicas_per_gpu(three, True, ray.cluster_resources())
        groups = place_replicas(ray, three, True, per_gpu, timeout_s=60)
        _, verifier, drafter = ray_gpus(three, True, per_gpu)
        gpu_ids = ray.remote(lambda: ray.get_gpu_ids())
        ids = [[ray.get(gpu_ids.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0), num_cpus=1,
                                        num_gpus=share).remote(), timeout=60) for share in (verifier, drafter)]
               for pg in groups]
        assert per_gpu == 2 and all(len(v) == 1 and v == d for v, d in ids), ids
        assert sorted(sorted(v[0] for v, _ in ids).count(g) for g in {v[0] for v, _ in ids}) == [1, 2], ids
        one = replicas_config(tiny_models, dflash_drafters, 1, device="cuda", gpu_memory_utilization=0.9)
        with pytest.raises(RoleStartError, match=r"server.replicas: Ray found no room for replica\(s\) \[0\] "
                                                 r"\(each .*'GPU': 1.0.*within 2 s; free now: .*'GPU': 0.5"):
            place_replicas(ray, one, True, replicas_per_gpu(one, True, ray.cluster_resources()), timeout_s=2)
        states = sorted(t["state"] for t in ray.util.placement_group_table().values())
        assert states == ["CREATED", "CREATED", "CREATED", "REMOVED"]
    finally:
        ray.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_on_cuda_in_bfloat16_invariant_mode_equals_plain_decoding(tiny_models, dflash_drafters, prompts):
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.step_loop import FinishEvent

    def run(engine, k):
        reqs = [engine.request(f"r{i}", p, 64, k) for i, p in enumerate(prompts)]
        return {e.request_id: list(e.token_ids) for e in engine.generate(reqs) if isinstance(e, FinishEvent)}

    target, drafter = tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"]
    plain = run(Engine(target, None, "none", max_batch=8, invariant=True, device="cuda", dtype=torch.bfloat16), None)
    engine = Engine(target, drafter, "dflash", max_batch=8, invariant=True, device="cuda", dtype=torch.bfloat16)
    assert engine.proposer.embedding.is_cuda
    for k in (3, 7):
        assert run(engine, k) == plain, f"k={k}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sampling_on_cuda_runs_its_rules_on_the_host(tiny_models, dflash_drafters, prompts):
    """Sampling requests on a GPU target: processors, warpers and acceptance run on the host; the seeded
    strict rule gives plain decoding's text (invariant mode, bf16), rejection sampling completes."""
    from blockspec.common.sampling import SamplingParams
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.step_loop import FinishEvent

    target, drafter = tiny_models["qwen3"]["target"], dflash_drafters["qwen3-trained"]
    engines = [Engine(target, d, m, max_batch=2, invariant=True, device="cuda", dtype=torch.bfloat16)
               for d, m in ((None, "none"), (drafter, "dflash"))]
    for rule in ("strict", "rejection"):
        outs = []
        for engine, k in zip(engines, (None, 5)):
            sp = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, seed=3, rule=rule)
            done = [e for e in engine.generate([engine.request("r", prompts[3], 48, k, sp)]) if isinstance(e, FinishEvent)]
            outs.append(list(done[0].token_ids))
        assert all(outs)
        if rule == "strict":
            assert outs[0] == outs[1]


def test_a_max_model_len_past_the_target_s_context_is_refused_by_the_plan(tiny_models, dflash_drafters):
    """Before: both roles started, and the verifier refused it naming its own flag, exit code 1."""
    with pytest.raises(InvalidArgument) as e:
        resolve_startup(config(tiny_models, dflash_drafters, max_model_len=99999))
    assert e.value.field == "model.max_model_len" and "99999 exceeds the model's context" in e.value.message
    assert resolve_startup(config(tiny_models, dflash_drafters, max_model_len=64))


def test_settings_of_a_disabled_spec_decode_are_said_to_be_ignored(tiny_models, dflash_drafters, caplog):
    """spec_decode.enabled: false serves plain decoding (no drafter role); a method or k set beside it is kept for
    when it is turned back on, and the log says it is ignored meanwhile."""
    import logging

    caplog.set_level(logging.WARNING, logger="blockspec.services.serving.serve")
    p = resolve_startup(config(tiny_models, dflash_drafters, spec_decode={"enabled": False, "method": "dflash",
                                                               "num_speculative_tokens": 7}))
    assert p.method == "none" and p.drafter_argv is None
    assert "spec_decode.method, spec_decode.num_speculative_tokens ignored" in caplog.text
    caplog.clear()
    resolve_startup(config(tiny_models, dflash_drafters, spec_decode={"enabled": False}))
    assert "ignored" not in caplog.text
