"""The split deployment: verifier and drafter roles behind gRPC, a router talking to them over
bidirectional streams; dflash maps the verifier's shared tensors. Output == the target alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from blockspec.common.telemetry.metrics import DEFAULT_VERSION
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.drafter.service import DrafterService
from blockspec.services.serving.launch import serve_drafter, serve_verifier, start_split_router, verifier_service
from tests.helpers import Loop, collect

AT = {"version": DEFAULT_VERSION}  # every router metric carries its serving version


def start_split(method: str, vsvc, dsvc, prefill_chunk: int = 32, **router_options) -> dict:
    """The two role services behind gRPC and a router over them; `stop_split` ends them."""
    loop = Loop()
    vserver, _, vport = loop.run(serve_verifier(vsvc))
    dserver, _, dport = loop.run(serve_drafter(dsvc))
    router = loop.run(start_split_router([(f"127.0.0.1:{vport}", f"127.0.0.1:{dport}")], method, max_batch=4,
                                         prefill_chunk=prefill_chunk, **router_options))
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}")
    return {"stub": api_grpc.GenerationStub(channel), "channel": channel, "router": router, "verifier": vsvc,
            "drafter": dsvc, "vserver": vserver, "dserver": dserver, "loop": loop, "method": method,
            "verifier_address": f"127.0.0.1:{vport}"}


def stop_split(split: dict) -> None:
    loop = split["loop"]
    split["channel"].close()
    loop.run(split["router"].stop(0))
    loop.run(split["vserver"].stop(0))
    loop.run(split["dserver"].stop(0))
    split["verifier"].close()
    split["drafter"].close()
    loop.close()


@pytest.fixture(scope="module", params=["dflash", "draft_model"])
def split(request, tiny_models, dflash_drafters):
    method = request.param
    target = str(tiny_models["qwen3"]["target"])
    drafter = str(dflash_drafters["qwen3-trained"] if method == "dflash" else tiny_models["qwen3"]["other"])
    vsvc = verifier_service(target, method, drafter, max_batch=4, max_len=None)
    dsvc = DrafterService(method, drafter, target, num_slots=4, max_len=512)
    # A small prefill chunk: the 100- and 150-token prompts continue their prefill over several ops.
    running = start_split(method, vsvc, dsvc)
    yield running
    stop_split(running)


def test_split_streams_equal_the_target_alone(split, prompts, references):
    check_streams(split, prompts, references)


def test_the_roles_hold_no_request_once_its_stream_ended(split, prompts):
    """Finished and cancelled streams: both roles forget them at once, not when the router's stream ends (before:
    the last requests' releases waited for an op that never came, and every SIGTERM or retired version logged one to
    four requests still held)."""
    import time

    check_streams(split, prompts[:3], None)
    assert split["verifier"].held == 0 and split["drafter"].held == 0
    req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[5]), max_tokens=400, num_speculative_tokens=5)
    call = split["stub"].Generate(req, timeout=120)
    next(call)  # running in both roles
    call.cancel()
    deadline = time.monotonic() + 10
    while (split["verifier"].held or split["drafter"].held) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert split["verifier"].held == 0 and split["drafter"].held == 0


def check_streams(split: dict, prompts, references) -> None:
    def one(i):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=128, num_speculative_tokens=5)
        return collect(split["stub"].Generate(req, timeout=120))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(len(prompts))))
    if references is None:  # only run them
        return
    for i, (ids, _, finish) in enumerate(results):
        assert ids == references["qwen3"][i], f"{split['method']} prompt {i}"
    assert sum(f.acceptance.drafted for _, _, f in results) > 0
    assert sum(f.acceptance.accepted for _, _, f in results) > 0


def test_prompt_lookup_over_remote_roles_streams_equal_the_target_alone(tiny_models, dflash_drafters, prompts,
                                                                         references):
    """With prompt lookup the router skips the remote drafter on the steps lookup drafts; the drafter then catches
    up on the context it did not see (tap features from the verifier's shared buffer)."""
    from prometheus_client import CollectorRegistry

    from blockspec.common.telemetry.metrics import RouterMetrics

    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-trained"])
    registry = CollectorRegistry()
    running = start_split("dflash", verifier_service(target, "dflash", drafter, max_batch=4, max_len=None),
                          DrafterService("dflash", drafter, target, num_slots=4, max_len=512), prompt_lookup=True,
                          metrics=RouterMetrics(registry))
    try:
        check_streams(running, prompts, references)
        looked_up = registry.get_sample_value("blockspec_spec_decode_num_lookup_drafts_total", AT)
        assert looked_up and looked_up < registry.get_sample_value("blockspec_spec_decode_num_drafts_total", AT)
    finally:
        stop_split(running)


def test_dflash_maps_the_verifiers_tensors(split):
    if split["method"] != "dflash":
        pytest.skip("only dflash shares the target's tensors")
    proposer = split["drafter"].proposer
    verifier = split["verifier"].verifier
    # Same memory, not a copy: a write through the verifier's tensor shows in the drafter's view.
    emb = verifier.runner.model.embed_tokens.weight
    old = float(emb[3, 0])
    emb.data[3, 0] = 123.0
    assert float(proposer.embedding[3, 0]) == 123.0
    emb.data[3, 0] = old


def test_the_verifier_measures_its_step_costs_for_adaptive_k(split):
    """What a router with adaptive k asks the remote verifier for before serving (InfoRequest)."""
    if split["method"] != "dflash":
        pytest.skip("one method is enough")
    from blockspec.services.router.roles import RemoteVerifier

    free = split["verifier"].verifier.free_slots  # the router hands finished requests back with its next op
    remote = RemoteVerifier(split["verifier_address"])
    try:
        costs = remote.measure_step_costs(3)
    finally:
        remote.close()
    assert costs.widths == (1, 2, 3) and costs.batch_sizes == (1, 2, 4)[: len(costs.batch_sizes)]
    assert max(costs.batch_sizes) <= free
    assert all(row[0] > 0 and list(row) == sorted(row) for row in costs.seconds)  # wider never cheaper
    assert split["verifier"].verifier.free_slots == free  # its scratch requests are gone


@pytest.mark.parametrize("rule", ["rejection", "strict"])
def test_split_sampling_equals_the_in_process_engine_for_a_seed(split, tiny_models, dflash_drafters, prompts, rule):
    """Sampling over the roles (the rejection rule's q travels through the verifier's shared buffer) gives
    the tokens the in-process engine gives for the same seed: same p, same q, same noise. A drafter role reads the
    verifier's LM head in place (fp32, no packed copy), so the in-process drafter runs its LM head the same way here:
    under `rejection` the text also follows the drafter's arithmetic (docs/sampling.md)."""
    from blockspec.common.sampling import SamplingParams
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.step_loop import FinishEvent

    method = split["method"]
    drafter = dflash_drafters["qwen3-trained"] if method == "dflash" else tiny_models["qwen3"]["other"]
    engine = Engine(tiny_models["qwen3"]["target"], drafter, method, max_batch=4)
    if method == "dflash" and engine.proposer._cpu is not None:
        engine.proposer._cpu.lm_head_panels = lambda lm_head: None  # the drafter role's LM head: not packed
    params = {"temperature": 0.9, "top_k": 40, "rule": rule}
    local = {}
    reqs = [engine.request(str(s), prompts[3], 40, 4, SamplingParams(**params, seed=s)) for s in range(4)]
    for event in engine.generate(reqs):
        if isinstance(event, FinishEvent):
            local[int(event.request_id)] = list(event.token_ids)
    accepted = 0
    for seed in range(4):
        req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[3]), max_tokens=40, num_speculative_tokens=4,
                                      sampling=api_pb2.SamplingParams(**params, seed=seed))
        ids, _, finish = collect(split["stub"].Generate(req, timeout=120))
        assert ids == local[seed], f"{method} {rule} seed {seed}"
        accepted += finish.acceptance.accepted
    assert accepted > 0
    assert len({tuple(v) for v in local.values()}) > 1


def test_bfloat16_roles_stream_what_the_engine_streams_in_bfloat16(tiny_models, dflash_drafters, prompts):
    """`blockspec role ... --dtype bfloat16` (config model.dtype): both roles hold bf16 weights, the drafter
    maps the verifier's bf16 tensors, and each stream equals the in-process engine's in bf16."""
    from blockspec.services.engine.engine import Engine
    from blockspec.services.router.step_loop import FinishEvent
    from blockspec.services.serving.launch import role_service
    from blockspec.services.serving.role_args import parse_role_args

    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-trained"])
    services = [role_service(parse_role_args(["role", role, "--target", target, "--method", "dflash", "--drafter",
                                               drafter, "--max-batch", "4", "--dtype", "bfloat16"]))
                for role in ("verifier", "drafter")]
    assert services[0].verifier.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert next(services[1].dflash_model.parameters()).dtype == torch.bfloat16
    running = start_split("dflash", *services, prefill_chunk=512)
    try:
        engine = Engine(target, drafter, "dflash", max_batch=4, dtype=torch.bfloat16)
        accepted = 0
        for i in (0, 3, 5):
            req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[i]), max_tokens=64, num_speculative_tokens=5)
            ids, _, finish = collect(running["stub"].Generate(req, timeout=120))
            local = [e for e in engine.generate([engine.request("r", prompts[i], 64, 5)]) if isinstance(e, FinishEvent)]
            assert ids == list(local[0].token_ids), f"prompt {i}"
            accepted += finish.acceptance.accepted
        assert accepted > 0
        assert running["drafter"].proposer.embedding.dtype == torch.bfloat16
    finally:
        stop_split(running)


def test_split_roles_preempt_and_resume_every_stream_exact(tiny_models, dflash_drafters, prompts):
    """A verifier role whose paged cache holds 160 positions, 4 streams of up to 120 through the router at once:
    admission waits for blocks, the router preempts the latest admitted as the others grow (its release and its
    resumed prefill travel over the role stream, the drafter rebuilds its context from the shared taps), and every
    stream is the target's greedy continuation with each token sent once."""
    from prometheus_client import CollectorRegistry

    from blockspec.common.telemetry.metrics import RouterMetrics
    from blockspec.services.serving.launch import KvCacheConfig
    from tests.helpers import hf_greedy

    target, drafter = str(tiny_models["qwen3"]["target"]), str(dflash_drafters["qwen3-trained"])
    registry = CollectorRegistry()
    running = start_split("dflash", verifier_service(target, "dflash", drafter, max_batch=4, max_len=160,
                                                     kv=KvCacheConfig(tokens=160)),
                          DrafterService("dflash", drafter, target, num_slots=4, max_len=160),
                          metrics=RouterMetrics(registry))
    try:
        def one(i):
            req = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[6][i : i + 20]), max_tokens=100,
                                          num_speculative_tokens=5)
            return collect(running["stub"].Generate(req, timeout=120))

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(4)))
        assert registry.get_sample_value("blockspec_num_preemptions_total", {"replica": "0", **AT}) > 0
        for i, (ids, _, finish) in enumerate(results):
            assert ids == hf_greedy(target, prompts[6][i : i + 20], 100), i
            assert finish.usage.completion_tokens == len(ids) and finish.usage.prompt_tokens == 20
        assert running["verifier"].held == 0 and running["drafter"].held == 0
    finally:
        stop_split(running)
