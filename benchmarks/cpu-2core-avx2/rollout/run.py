"""A blue/green rollout under a steady load: `serve --no-ray` of the shipped pair as version "blue" (deploy/config.yaml,
max_batch 4, a management port), clients streaming greedy requests throughout (so the new version's checks run
beside the load, and its ratio is asked only to exceed 1); `blockspec rollout start --wait` of
version "green" (the same pair at num_speculative_tokens 7), `promote`, then `rollback`; each command timed from its
start to its exit. Each stream records the
version its response metadata names and is compared with plain decoding of its prompt. Writes summary.json beside
this file.

    .venv/bin/python benchmarks/cpu-2core-avx2/rollout/run.py [--clients 4] [--phase-s 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from blockspec.protos import api_grpc, api_pb2

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KEY = "rollout-benchmark-admin-key"


def configs(work: Path) -> tuple[Path, Path]:
    (work / "admin.key").write_text(KEY + "\n")
    text = (ROOT / "deploy" / "config.yaml").read_text()
    text = text.replace("  port: 8000 ", "  port: 0 ").replace("  grpc_port: 8001 ", "  grpc_port: 0 ")
    text = text.replace("server:\n", f"server:\n  max_batch: 4\n  admin: {{port: 0, key_file: {work / 'admin.key'}, "
                        "rollout_grace_s: 300, min_speedup: 1.0}\n", 1)
    text = text.replace("model:\n", "model:\n  version: blue\n", 1)
    (work / "blue.yaml").write_text(text)
    target, drafter = ROOT / "models" / "base" / "target", ROOT / "models" / "base" / "drafter"
    (work / "green.yaml").write_text(f"model:\n  version: green\n  target_model_path: {target}\n"
                                     f"  draft_model_path: {drafter}\n  spec_decode: {{num_speculative_tokens: 7}}\n")
    return work / "blue.yaml", work / "green.yaml"


def rollout(admin: int, key_file: Path, *args: str) -> float:
    """`blockspec rollout ARGS`; the seconds it took."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "blockspec.services.cli", "rollout", *args, "--admin", f"127.0.0.1:{admin}",
                    "--admin-key-file", str(key_file)], check=True, cwd=ROOT)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=20.0, help="load before the promote, between, and after")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    blue, green = configs(work)
    log = (work / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", "-v", "serve", "--config", str(blue),
                             "--no-ray"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    ports = {}
    for line in proc.stdout:
        if line.startswith("ADMIN "):
            ports["admin"] = int(line.split()[1])
        if line.startswith("SERVING "):
            ports.update({k: int(v) for k, v in (p.split("=") for p in line.split()[1:])})
            break
    stop = threading.Event()
    try:
        stub = api_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}"))
        texts = [json.loads(line) for line in (ROOT / "models" / "base" / "heldout_prompts.jsonl").read_text().splitlines()]
        prompts = [list(stub.Tokenize(api_pb2.TokenizeRequest(text=t)).token_ids) for t in texts]
        results: list[dict] = []

        def client(c: int) -> None:
            i = c
            while not stop.is_set():
                p = i % len(prompts)
                sent = time.monotonic()
                call = stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[p]), max_tokens=64),
                                     timeout=600)
                try:
                    tokens = [t for m in call for t in m.token_ids]
                    results.append({"prompt": p, "sent": sent, "version": dict(call.initial_metadata())["blockspec-version"],
                                    "tokens": tokens})
                except grpc.RpcError as e:
                    results.append({"prompt": p, "sent": sent, "error": f"{e.code().name}: {e.details()}"})
                i += args.clients

        clients = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in clients:
            t.start()
        key_file = work / "admin.key"
        start_s = rollout(ports["admin"], key_file, "start", "--config", str(green), "--wait")
        time.sleep(args.phase_s)
        promoted_at = time.monotonic()
        promote_s = rollout(ports["admin"], key_file, "promote")
        time.sleep(args.phase_s)
        rolled_back_at = time.monotonic()
        rollback_s = rollout(ports["admin"], key_file, "rollback")
        time.sleep(args.phase_s)
        stop.set()
        for t in clients:
            t.join()
        status = subprocess.run([sys.executable, "-m", "blockspec.services.cli", "rollout", "status", "--json", "--admin",
                                 f"127.0.0.1:{ports['admin']}", "--admin-key-file", str(key_file)], check=True,
                                capture_output=True, text=True, cwd=ROOT).stdout
        plain = {}
        for p in sorted({r["prompt"] for r in results}):
            msg = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompts[p]), max_tokens=64,
                                          num_speculative_tokens=0)
            plain[p] = [t for m in stub.Generate(msg, timeout=600) for t in m.token_ids]
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
    served = [r for r in results if "error" not in r]
    after_rollback = [r for r in served if r["sent"] > rolled_back_at]
    green_after = [r["sent"] - rolled_back_at for r in after_rollback if r["version"] == "green"]
    summary = {
        "clients": args.clients, "phase_s": args.phase_s, "streams": len(results),
        "failed": [r["error"] for r in results if "error" in r],
        "differ_from_plain": sum(r["tokens"] != plain[r["prompt"]] for r in served),
        "by_version": {v: sum(r["version"] == v for r in served) for v in ("blue", "green")},
        "green_before_promote": sum(r["version"] == "green" and r["sent"] < promoted_at for r in served),
        "rollout_start_wait_s": round(start_s, 1), "promote_command_s": round(promote_s, 3),
        "rollback_command_s": round(rollback_s, 3),
        "last_green_request_after_rollback_s": round(max(green_after), 3) if green_after else None,
        "first_blue_request_after_rollback_s": round(min((r["sent"] - rolled_back_at for r in after_rollback
                                                          if r["version"] == "blue"), default=float("nan")), 3),
        "releases_at_end": [(r["version"], r["state"]) for r in json.loads(status)["releases"]],
    }
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
