"""server.autoscaling on `serve --no-ray`: a queue that builds starts a second replica (its role processes), the
load ending drains it back to one; every stream is the target alone's, none fails."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import CONFIG, generate, metric, role_pids, spawn_serve, stop_serve, wait_for


def gauge(port: int, name: str, labels: str = "") -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return metric(r.read().decode(), name, labels)


AUTOSCALING = ("  max_batch: 1\n  autoscaling: {min_replicas: 1, max_replicas: 2, target_waiting_per_replica: 1, "
               "scale_up_delay_s: 0, scale_down_delay_s: 1}\n")
TWO_REPLICAS = "  max_batch: 2\n  replicas: 2\n"


def serve_replicas(tiny_models, dflash_drafters, tmp_path, server_keys: str, *args: str) -> tuple[dict, Path]:
    """`serve -v` of the tiny qwen3 pair with `server_keys` in place of the test config's max_batch, and `args`
    (--no-ray, --ray-address ...): its info and the path of its log."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=dflash_drafters["qwen3-trained"])
                   .replace("  max_batch: 4\n", server_keys))
    log = tmp_path / "serve.log"
    with log.open("w") as stderr:
        return spawn_serve("--config", str(cfg), *args, stderr=stderr, verbose=True), log


def test_replicas_follow_the_queue_up_to_max_and_back_to_min(tiny_models, dflash_drafters, tmp_path, prompts,
                                                             references):
    info, log = serve_replicas(tiny_models, dflash_drafters, tmp_path, AUTOSCALING, "--no-ray")
    port = info["http"]

    def ready() -> float | None:
        return gauge(port, "blockspec_replicas", '{state="ready"}')

    try:
        work = [i % len(prompts) for i in range(24)]
        with ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(generate, info["stub"], prompts[i], 128, 300) for i in work]
            assert wait_for(lambda: ready() == 2, 120), log.read_text()[-2000:]
            assert len(role_pids(info["proc"], "role verifier")) == 2
            outputs = [f.result() for f in futures]
        for i, (ids, _, finish) in zip(work, outputs, strict=True):
            assert ids == references["qwen3"][i][:128] and finish.reason in ("length", "stop")
        assert wait_for(lambda: ready() == 1 and gauge(port, "blockspec_replicas", '{state="draining"}') == 0, 60)
        assert wait_for(lambda: re.search(r"autoscaling: replica \d stopped", log.read_text()), 60)
        assert len(role_pids(info["proc"], "role verifier")) == len(role_pids(info["proc"], "role drafter")) == 1
        ids, _, _ = generate(info["stub"], prompts[4], 32)  # the replica left serves on
        assert ids == references["qwen3"][4][:32]
    finally:
        stop_serve(info)
    text = log.read_text()
    assert "autoscaling: 1 -> 2 replicas:" in text and "requests waiting over 1 replicas" in text
    assert "autoscaling: replica 1 is ready" in text
    assert re.search(r"autoscaling: replica \d drains", text)


@pytest.mark.slow  # 50 s of two replicas' role processes; the default run keeps the scale up/down test
def test_a_replica_whose_verifier_dies_is_replaced_while_the_other_serves(tiny_models, dflash_drafters, tmp_path,
                                                                           prompts, references):
    """Two replicas; one's verifier is killed mid-stream: its streams end UNAVAILABLE (retriable), the other
    replica's finish as the target alone's, the server stays up, and a new replica takes the lost one's place.
    /health says degraded, naming replica 0, from the loss until the replacement is ready (before: `ok` while the
    replacement started, and the wrong replica named)."""
    import os
    import signal

    import grpc

    info, log = serve_replicas(tiny_models, dflash_drafters, tmp_path, TWO_REPLICAS, "--no-ray")
    health: list[tuple[float | None, str]] = []  # (ready replicas, /health's text) sampled from the kill on
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            ready = gauge(info["http"], "blockspec_replicas", '{state="ready"}')
            with urllib.request.urlopen(f"http://127.0.0.1:{info['http']}/health", timeout=5) as r:
                health.append((ready, r.read().decode()))
            time.sleep(0.2)

    try:
        verifiers = role_pids(info["proc"], "role verifier")
        assert len(verifiers) == 2
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(generate, info["stub"], prompts[i], 128, 300) for i in (2, 3, 4, 5)]
            assert wait_for(lambda: gauge(info["http"], "blockspec_requests_running", '{replica="0"}') == 2, 60)
            os.kill(verifiers[0], signal.SIGKILL)
            watcher = threading.Thread(target=watch)
            watcher.start()
            outcomes = []
            for i, f in zip((2, 3, 4, 5), futures, strict=True):
                try:
                    ids, _, _ = f.result()
                    outcomes.append("ok")
                    assert ids == references["qwen3"][i][:128]
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE and "can be sent again" in e.details()
                    outcomes.append("unavailable")
        assert sorted(set(outcomes)) == ["ok", "unavailable"] and info["proc"].poll() is None
        assert wait_for(lambda: len(role_pids(info["proc"], "role verifier")) == 2, 60)
        assert wait_for(lambda: gauge(info["http"], "blockspec_replicas", '{state="ready"}') == 2, 60)
        assert wait_for(lambda: health and health[-1][1] == "ok\n", 10), health[-5:]
        watching.set()
        watcher.join(10)
        for i in (6, 7):
            ids, _, _ = generate(info["stub"], prompts[i], 32)
            assert ids == references["qwen3"][i][:32]
    finally:
        watching.set()
        stop_serve(info)
    text = log.read_text()
    assert "lost its verifier" in text and "in place of replica 0" in text
    short = [h for ready, h in health if ready is not None and ready < 2]
    assert short and all(h.startswith("degraded: replica 0: verifier ") for h in short), sorted(set(health), key=str)
    assert any("replica 0: verifier lost, its replacement is starting" in h for h in short)
    first_ok = next(i for i, (_, h) in enumerate(health) if h == "ok\n")
    assert all(h.startswith("degraded: replica 0") for _, h in health[:first_ok]), sorted(set(health), key=str)


@pytest.mark.slow  # a local Ray cluster and a second placement group: a minute and more
@pytest.mark.e2e
def test_on_ray_a_replica_is_a_placement_group_added_and_removed_with_the_queue(tiny_models, dflash_drafters, tmp_path,
                                                                                 prompts, references):
    info, log = serve_replicas(tiny_models, dflash_drafters, tmp_path, AUTOSCALING)
    port = info["http"]
    try:
        work = [i % len(prompts) for i in range(32)]
        with ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(generate, info["stub"], prompts[i], 128, 600) for i in work]
            assert wait_for(lambda: gauge(port, "blockspec_replicas", '{state="ready"}') == 2, 300), \
                log.read_text()[-2000:]
            outputs = [f.result() for f in futures]
        for i, (ids, _, _) in zip(work, outputs, strict=True):
            assert ids == references["qwen3"][i][:128]
        assert wait_for(lambda: re.search(r"autoscaling: replica \d stopped", log.read_text()), 120)
        assert wait_for(lambda: gauge(port, "blockspec_replicas", '{state="ready"}') == 1, 10)
        ids, _, _ = generate(info["stub"], prompts[4], 32)
        assert ids == references["qwen3"][4][:32]
    finally:
        stop_serve(info)


@pytest.mark.slow  # three Ray nodes on this machine, a node killed: two minutes and more
@pytest.mark.e2e
def test_two_nodes_one_killed_mid_stream_its_requests_end_unavailable_and_a_new_node_takes_the_replica(
        tiny_models, dflash_drafters, tmp_path, prompts, references):
    """A head and a worker node (2 CPUs each: one replica each). The worker dies mid-stream: its replica's streams
    end UNAVAILABLE, the head's finish as the target alone's, the server serves on. A node added afterwards (as the
    Ray autoscaler would) takes the replacement replica."""
    import grpc
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = cluster.add_node(num_cpus=2)
    try:
        info, log = serve_replicas(tiny_models, dflash_drafters, tmp_path, TWO_REPLICAS, "--ray-address",
                                   cluster.address)
        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(generate, info["stub"], prompts[i], 128, 300) for i in (2, 3, 4, 5)]
                assert wait_for(lambda: sum(gauge(info["http"], "blockspec_requests_running", f'{{replica="{r}"}}')
                                            or 0 for r in "01") == 4, 120)
                cluster.remove_node(worker, allow_graceful=False)
                outcomes = []
                for i, f in zip((2, 3, 4, 5), futures, strict=True):
                    try:
                        ids, _, _ = f.result()
                        assert ids == references["qwen3"][i][:128]
                        outcomes.append("ok")
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                        outcomes.append("unavailable")
            assert sorted(set(outcomes)) == ["ok", "unavailable"] and info["proc"].poll() is None
            ids, _, _ = generate(info["stub"], prompts[6], 32)  # the head's replica serves meanwhile
            assert ids == references["qwen3"][6][:32]
            cluster.add_node(num_cpus=2)
            assert wait_for(lambda: gauge(info["http"], "blockspec_replicas", '{state="ready"}') == 2, 300), \
                log.read_text()[-2000:]
            for i in (0, 1, 7):
                ids, _, _ = generate(info["stub"], prompts[i], 32)
                assert ids == references["qwen3"][i][:32]
        finally:
            stop_serve(info)
    finally:
        cluster.shutdown()
    assert "lost its verifier" in log.read_text()
