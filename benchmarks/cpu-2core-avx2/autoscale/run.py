"""Load test of server.autoscaling: `serve --no-ray` of the shipped pair (deploy/config.yaml with max_batch 2 and
autoscaling 1..3 replicas), a load of greedy streams that builds a queue, then none; /metrics polled twice a second.
Every stream is compared with plain decoding (num_speculative_tokens 0) of its prompt on the same server. Writes
timeline.csv, timeline.png and summary.json beside this file.

    .venv/bin/python benchmarks/cpu-2core-avx2/autoscale/run.py [--clients 12] [--load-s 60]
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from blockspec.protos import api_grpc, api_pb2

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GAUGES = {"waiting": ("blockspec_autoscale_waiting_requests", ""), "desired": ("blockspec_replicas", "desired"),
          "ready": ("blockspec_replicas", "ready"), "starting": ("blockspec_replicas", "starting"),
          "draining": ("blockspec_replicas", "draining")}


def config(path: Path) -> None:
    text = (ROOT / "deploy" / "config.yaml").read_text()
    text = text.replace("  port: 8000 ", "  port: 0 ").replace("  grpc_port: 8001 ", "  grpc_port: 0 ")
    text = text.replace("server:\n", "server:\n  max_batch: 2\n  autoscaling: {min_replicas: 1, max_replicas: 3, "
                        "target_waiting_per_replica: 2, scale_up_delay_s: 2, scale_down_delay_s: 10}\n", 1)
    path.write_text(text)


def read_gauges(http: int) -> dict:
    """Each gauge summed over its series (every series also carries its version)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=5) as r:
        samples = [s for f in text_string_to_metric_families(r.read().decode()) for s in f.samples]
    return {key: sum(s.value for s in samples if s.name == name and s.labels.get("state", "") == state)
            for key, (name, state) in GAUGES.items()}


def stream(stub, ids: list[int], k: int | None) -> list[int]:
    msg = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), max_tokens=64)
    if k is not None:
        msg.num_speculative_tokens = k
    return [t for m in stub.Generate(msg, timeout=600) for t in m.token_ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--load-s", type=float, default=60.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    config(work / "config.yaml")
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "-v", "serve", "--config",
                             str(work / "config.yaml"), "--no-ray"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                            text=True)
    ports = {}
    for line in proc.stdout:
        if line.startswith("SERVING "):
            ports = {k: int(v) for k, v in (p.split("=") for p in line.split()[1:])}
            break
    stub = api_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
    texts = [json.loads(line) for line in (ROOT / "models" / "base" / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = [list(stub.Tokenize(api_pb2.TokenizeRequest(text=t)).token_ids) for t in texts]
    started, stop_load, done = time.monotonic(), threading.Event(), threading.Event()
    results: list[tuple[int, list[int] | str]] = []
    timeline: list[dict] = []

    def poll() -> None:
        while not done.is_set():
            timeline.append({"t": round(time.monotonic() - started, 2), **read_gauges(ports["http"])})
            time.sleep(0.5)

    def client(c: int) -> None:
        i = c
        while not stop_load.is_set():
            p = i % len(prompts)
            try:
                results.append((p, stream(stub, prompts[p], None)))
            except grpc.RpcError as e:
                results.append((p, f"{e.code().name}: {e.details()}"))
            i += args.clients

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(5)
    clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in clients:
        t.start()
    time.sleep(args.load_s)
    stop_load.set()
    for t in clients:
        t.join()
    load_ended = time.monotonic() - started
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (timeline[-1]["ready"] > 1 or timeline[-1]["draining"] > 0):
        time.sleep(1)
    time.sleep(3)
    done.set()
    poller.join()
    plain = {p: stream(stub, prompts[p], 0) for p in sorted({p for p, _ in results})}
    proc.terminate()
    proc.wait(60)
    failed = [r for _, r in results if isinstance(r, str)]
    differ = [p for p, r in results if not isinstance(r, str) and r != plain[p]]
    with (HERE / "timeline.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(timeline[0]))
        w.writeheader()
        w.writerows(timeline)
    summary = {"clients": args.clients, "load_s": args.load_s, "load_ended_s": round(load_ended, 1),
               "streams": len(results), "failed": len(failed), "differ_from_plain": len(differ),
               "max_ready": max(r["ready"] for r in timeline), "final_ready": timeline[-1]["ready"],
               "decisions": [line.split("serving.autoscaler: ", 1)[1] for line in (work / "serve.log").read_text()
                             .splitlines() if "serving.autoscaler: " in line]}
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(timeline, load_ended)
    print(json.dumps(summary, indent=1))


def plot(timeline: list[dict], load_ended: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in timeline]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.plot(t, [r["waiting"] for r in timeline], label="requests waiting", color="tab:orange")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests waiting")
    ax2 = ax.twinx()
    ax2.step(t, [r["ready"] for r in timeline], where="post", label="replicas ready", color="tab:blue")
    ax2.step(t, [r["desired"] for r in timeline], where="post", label="replicas desired", color="tab:blue",
             linestyle=":")
    ax2.set_ylabel("replicas")
    ax2.set_ylim(0, max(r["desired"] for r in timeline) + 1)
    ax.axvspan(5, load_ended, color="0.92", label="load")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "timeline.png", dpi=110)


if __name__ == "__main__":
    main()
