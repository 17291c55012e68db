"""What more than one test module uses: the reference outputs, the statistics of the sampling checks, routers run in
this process and `blockspec serve` run as a child process.

Test modules import these from here and never from one another (tests/test_layout.py checks it); fixtures stay in
conftest.py, which imports its constants and the transformers oracle from here too.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import openai
import psutil
import torch

from blockspec.common.sampling import SamplingParams
from blockspec.common.telemetry.metrics import RouterMetrics
from blockspec.protos import api_grpc, api_pb2
from blockspec.services.engine.engine import Engine
from blockspec.services.router.app import start_router
from blockspec.services.router.http import Ready, start_http
from blockspec.services.router.openai_http import Upstream, V1App
from blockspec.services.router.step_loop import FinishEvent

# --- Tiny models and the transformers oracle ----------------------------------------------------------------------

NEW_TOKENS = 128  # tokens the target-alone references (conftest's `references`) generate per prompt
DRAFT_VOCAB_SIZE = 128  # of the tiny vocabulary's 320 tokens


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int = NEW_TOKENS, **settings) -> list[int]:
    """The oracle: transformers `generate(do_sample=False)` of the model alone (with `settings` such as
    repetition_penalty); generated ids only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, **settings)
    return out[0, len(prompt_ids) :].tolist()


HYBRID = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def base_config(family: str, vocab: int) -> dict:
    """A small config of the family: 4 query heads over 2 KV heads of 32 dims (hidden 64), 2 layers (dense) or 3
    linear-attention layers and a full one (hybrids) with 4 value heads over 2 key heads. No end-of-sequence id: the
    greedy continuations run their full length."""
    cfg = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "num_hidden_layers": 2}
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        cfg.update(HYBRID, num_hidden_layers=4)
    if family in ("qwen3_moe", "qwen3_5_moe", "qwen3_next"):
        cfg.update(MOE)
    if family in ("qwen3_5_moe", "qwen3_next"):
        cfg["shared_expert_intermediate_size"] = 48
    if family == "qwen3_5_moe":
        del cfg["intermediate_size"]  # not a key of its config (every layer routed)
    return cfg


# --- Sampling: sampled sequences against the target's exact distribution (chi-square) ------------------------------

SAMPLES = 10_000  # sequences per check: the rule that skips the p/q test still reads p far below P_FAIL
# A correct sampler fails one check with probability P_FAIL (chi-square p-value below it). The runs are
# seeded, so on one machine the outcome is fixed; but the tiny pair is trained where the tests run, and another
# CPU type trains another pair: a new draw. At 1e-3 the default run's 6 checks would fail a correct sampler on 0.6%
# of machine types; at 1e-6 almost never, while a rule that skips the p/q test still reads p = 0.0 (below).
P_FAIL = 1e-6
MIN_EXPECTED = 5  # cells expected less often are merged into one "rest" cell (the chi-square rule of thumb)


def hf_probs(model, prefixes: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """p of the next token after each prefix [n, V], from transformers' own logits warpers (not ours)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    ids = torch.tensor(prefixes)
    with torch.no_grad():
        logits = model(ids).logits[:, -1].double()
    return warpers(ids, logits).softmax(-1)


def exact_cells(target: Path, prompt: list[int], params: SamplingParams, depth: int, n: int) -> dict[tuple, float]:
    """P(t1..t_depth) for every sequence expected at least MIN_EXPECTED times in n samples.

    A prefix less likely than that cannot hold such a cell, so only likelier prefixes are expanded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    floor = MIN_EXPECTED / n
    level = {(): 1.0}
    for _ in range(depth):
        prefixes = list(level)
        probs = torch.cat([hf_probs(model, [prompt + list(p) for p in prefixes[i : i + 256]], params)
                           for i in range(0, len(prefixes), 256)])
        nxt = {}
        for prefix, row in zip(prefixes, probs):
            mass = level[prefix] * row
            for t in torch.nonzero(mass >= floor).flatten().tolist():
                nxt[prefix + (t,)] = float(mass[t])
        level = nxt
    return level


def chi_square_p(observed: Counter, cells: dict[tuple, float], n: int) -> float:
    """Pearson's test of the observed sequences against the exact cells (+ one cell for all the rest)."""
    expected = {c: n * p for c, p in cells.items()}
    rest_expected = n - sum(expected.values())
    stat = sum((observed.get(c, 0) - e) ** 2 / e for c, e in expected.items())
    dof = len(expected) - 1
    if rest_expected >= MIN_EXPECTED:
        rest_observed = n - sum(observed.get(c, 0) for c in expected)
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_sequences(engine: Engine, prompt: list[int], params: SamplingParams, depth: int, k: int | None, n: int,
                     seed0: int = 0) -> tuple[Counter, float]:
    """n generations of `depth` tokens (request i seeded seed0 + i) -> counts of the sequences, acceptance."""
    from dataclasses import replace

    counts, drafted, accepted = Counter(), 0, 0
    requests = [engine.request(str(i), prompt, depth, k, replace(params, seed=seed0 + i)) for i in range(n)]
    for event in engine.generate(requests):
        if isinstance(event, FinishEvent):
            counts[tuple(event.token_ids)] += 1
            drafted, accepted = drafted + event.stats.drafted, accepted + event.stats.accepted
    assert sum(counts.values()) == n and all(len(s) == depth for s in counts)
    return counts, accepted / max(drafted, 1)


def with_sampling_top_k(drafter: Path, width: int, out: Path) -> Path:
    """A copy of a DFlash drafter checkpoint whose sampling walks draw from `width` candidates a slot."""
    shutil.copytree(drafter, out)
    raw = json.loads((out / "config.json").read_text())
    raw["dflash_config"]["sampling_top_k"] = width
    (out / "config.json").write_text(json.dumps(raw))
    return out


# --- Routers in this process ---------------------------------------------------------------------------------------


class Loop:
    """An asyncio event loop running in a background thread, for coroutines called from a test's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RouterThread:
    """A router on a free port, its asyncio loop in a background thread."""

    def __init__(self, engine: Engine, metrics: RouterMetrics | None = None, api_keys=None, limits=None,
                 replicas: tuple[Engine, ...] = (), tls=None) -> None:
        """replicas: more engines, each one more replica of the router (facts from the first); tls: a ServerTls."""
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.router = asyncio.run_coroutine_threadsafe(
            start_router([engine.loop, *(e.loop for e in replicas)], engine.facts(), metrics=metrics,
                         api_keys=api_keys, limits=limits, tls=tls),
            self.loop).result(60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.router.port}")
        self.stub = api_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.router.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


SERVED_KEY = "o" * 24  # the API key Served's OpenAI client sends


class Served:
    """A router on a free port with the HTTP server in front, as `serve` runs them."""

    def __init__(self, engine: Engine, **router_kwargs) -> None:
        self.router = RouterThread(engine, **router_kwargs)
        keys = router_kwargs.get("api_keys")
        self.http = start_http("127.0.0.1", 0, lambda: Ready(True, "ok\n"), keys,
                               V1App(Upstream(lambda: f"127.0.0.1:{self.router.router.port}")))
        self.port = self.http.server_port
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=SERVED_KEY, max_retries=0,
                                    timeout=120)

    def close(self) -> None:
        self.http.shutdown()
        self.router.close()

    def raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One plain HTTP request: (status, headers, body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        result = response.status, response.headers, response.read()  # headers: case-insensitive
        conn.close()
        return result


def collect(stream) -> tuple[list[int], str, api_pb2.Finish]:
    """A Generate stream read to its end: (token ids, text, the Finish message)."""
    ids, text, finish = [], "", None
    for msg in stream:
        ids += msg.token_ids
        text += msg.text
        if msg.HasField("finish"):
            finish = msg.finish
    return ids, text, finish


def slow_steps(seconds: float):
    """A wrap for an engine: every proposal takes `seconds` (a step in flight the event loop can act during)."""
    def wrap(engine):
        propose = engine.loop.drafter.propose

        def slow(inputs):
            time.sleep(seconds)
            return propose(inputs)

        engine.loop.drafter.propose = slow
    return wrap


# --- `blockspec serve` as a child process --------------------------------------------------------------------------

# The operators' seed config (tests/common/test_config.py loads it).
SEED = """
server:
  port: 8000
  workers: 1
model:
  target_model_path: "/data/models/target_model"
  draft_model_path: "/data/models/draft_model"
  spec_decode:
    enabled: true
    num_speculative_tokens: 5
    draft_model_dtype: "float16"
    use_dynamic_conv: true
    use_path_selector: true
  tensor_parallel_size: 1
  gpu_memory_utilization: 0.9
"""

# The operators' seed config on free ports, with the models filled in.
CONFIG = (SEED.replace('"/data/models/target_model"', '"{target}"').replace('"/data/models/draft_model"', '"{drafter}"')
          .replace("  port: 8000\n", "  port: 0\n  grpc_port: 0\n  max_batch: 4\n"))


def config_with_a_broken_drafter(tiny_models, dflash_drafters, tmp_path):
    """A config whose drafter's weights file is cut short: (the config's path, the weights file)."""
    drafter = tmp_path / "drafter"
    shutil.copytree(dflash_drafters["qwen3-trained"], drafter)
    weights = next(drafter.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(target=tiny_models["qwen3"]["target"], drafter=drafter))
    return cfg, weights


def spawn_serve(*args: str, cwd=None, env: dict | None = None, stderr=None, verbose: bool = False) -> dict:
    """`blockspec serve ARGS` as a child process, once it serves: its proc, ports, a stub, and the
    /health status seen while the roles were still loading. stderr: a file for the server's and its roles' logs."""
    proc = subprocess.Popen([sys.executable, "-m", "blockspec.services.cli", *(("-v",) if verbose else ()), "serve",
                             *args], cwd=cwd, stderr=stderr, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    info = {"proc": proc, "before": None}
    for line in proc.stdout:
        if line.startswith("HTTP "):
            info["http"] = int(line.split()[1])
            info["before"] = http_status(info["http"])  # roles still loading
        if line.startswith("ADMIN "):
            info["admin"] = int(line.split()[1])
        if line.startswith("SERVING "):
            info["grpc"] = int(line.split()[1].split("=")[1])
            break
    assert "grpc" in info, f"serve exited with code {proc.wait()} before serving"
    info["channel"] = grpc.insecure_channel(f"127.0.0.1:{info['grpc']}")
    info["stub"] = api_grpc.GenerationStub(info["channel"])
    return info


def stop_serve(info: dict) -> None:
    """SIGTERM to a `spawn_serve` server, waited for."""
    info["channel"].close()
    info["proc"].send_signal(signal.SIGTERM)
    info["proc"].wait(60)


def role_pids(proc: subprocess.Popen, role: str) -> list[int]:
    """The live child processes of a server whose command line names `role`."""
    pids = []
    for child in psutil.Process(proc.pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and role in " ".join(child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:  # exited in between
            continue
    return pids


def http_status(port: int, path: str = "/health") -> int:
    """The HTTP status of a GET on 127.0.0.1:port, error statuses included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def metric(text: str, name: str, labels: str = "") -> float | None:
    """The sum of `name`'s series in Prometheus text whose labels include `labels` (`{state="ready"}`; every series
    also carries its serving version); None where none has them."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == name and wanted.items() <= s.labels.items()]
    return sum(values) if values else None


def wait_for(condition, seconds: float = 120.0) -> bool:
    """Poll condition() every 0.05 s until it holds or `seconds` pass (a step thread acts between steps; a role start
    takes 4-9 s here, Ray's far longer on a loaded machine: the deadline is for the worst case, a passing run returns
    at once)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def generate(stub, ids, max_tokens=128, timeout=120):
    """A Generate of `ids` through a gRPC stub, read to its end (`collect`)."""
    return collect(stub.Generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids), max_tokens=max_tokens),
                                 timeout=timeout))


def drafted_once_back(stub, ids, reference, max_tokens: int, seconds: float = 60.0) -> int:
    """Generate until a stream has drafts again (the router reconnects to a restarted drafter on its next retry),
    every stream the target alone's text; the last stream's drafted tokens."""
    deadline, drafted = time.monotonic() + seconds, 0
    while not drafted and time.monotonic() < deadline:
        out = generate(stub, ids, max_tokens)
        assert out[0] == reference[:max_tokens]
        drafted = out[2].acceptance.drafted
        time.sleep(0 if drafted else 1)
    return drafted
