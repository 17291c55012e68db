"""The go-live checks of a served pair, in order - ready, identity, ratio, acceptance, latency, memory per role,
tokenizer alignment - against a server's gRPC API (and its HTTP port where given): `blockspec validate` prints them,
a rollout runs them on a candidate before it takes requests."""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from blockspec.common.errors import InvalidArgument
from blockspec.common.wire.tls import http_url

if TYPE_CHECKING:
    import grpc

    from blockspec.common.models.checkpoint import Checkpoint
    from blockspec.common.wire.tls import ClientTls
    from blockspec.protos.api_pb2 import ModelInfoResponse
    from blockspec.services.bench.modes import Row

DEFAULT_MIN_RATIO = 2.7  # speculative over plain tokens/s at concurrency 1 that a deployment must reach
ACCEPTANCE_ALERT = 0.25  # BlockspecAcceptanceLow's floor in deploy/prometheus/alerts.yml (a test keeps them equal)
CHECKS = ("ready", "identity", "ratio", "acceptance", "latency", "memory", "tokenizer")
MEASURED = ("identity", "ratio", "acceptance", "latency")  # the checks the timed passes feed
TIMEOUT_S = 10.0  # each health, info, tokenize and HTTP call


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "pass", "fail", "info" (reported, no threshold given) or "skip" (could not run: `detail` says why)
    detail: str
    figures: dict = field(default_factory=dict)  # --json: the numbers behind `detail`


@dataclass(frozen=True)
class Bounds:
    """What the measured checks run and require: `max_tokens` a request over `rounds` timed passes of each k; the
    speculative / plain ratio and the acceptance rate at least `min_ratio` and `min_acceptance`; p99 latencies at
    most the limits given (None: reported only); `reference`: HOST:PORT of a server whose plain decoding the identity
    check compares with (None: the checked server at k = 0)."""

    max_tokens: int = 128
    rounds: int = 3
    min_ratio: float = DEFAULT_MIN_RATIO
    min_acceptance: float = ACCEPTANCE_ALERT
    max_ttft_ms: float | None = None
    max_itl_ms: float | None = None
    reference: str | None = None


@dataclass(frozen=True)
class Client:
    """How `validate` reaches the validated server and the reference: $BLOCKSPEC_API_KEY sent, TLS as its flags
    ask."""

    tls: ClientTls | None = None

    def channel(self, where: str) -> grpc.Channel:
        from blockspec.common.wire.auth import client_channel

        return client_channel(where, tls=self.tls)

    def get(self, where: str, path: str) -> tuple[int, str]:
        """GET WHERE/PATH -> (status, body); an error status is an answer too. A server that does not answer raises
        URLError or OSError."""
        from blockspec.common.wire.auth import ENV_API_KEY

        key = os.environ.get(ENV_API_KEY)
        base, context = http_url(where, self.tls)
        request = urllib.request.Request(f"{base}{path}", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as r:
                return r.status, r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")


def run_checks(where: str, http: str | None, texts: list[str], bounds: Bounds, tls: ClientTls | None = None) -> dict:
    """Every check against the server at `where` (gRPC) and `http` (its HTTP port, or None) -> the result: the
    server, the run's figures and the `Check`s in order."""
    import grpc

    from blockspec.protos import api_grpc, api_pb2

    client = Client(tls)
    ready, info = check_ready(client, where, http)
    result = {"server": where, "http": http, "reference": bounds.reference, "prompts": len(texts),
              "max_tokens": bounds.max_tokens, "rounds": bounds.rounds, "checks": [ready]}
    if info is None:  # nothing else can run
        result["checks"] += [Check(name, "skip", "the server's API did not answer") for name in CHECKS[1:]]
        return result
    result["model"] = {"target": info.target, "drafter": info.drafter, "method": info.method,
                       "k": info.default_speculative_tokens}
    try:
        with client.channel(where) as channel:
            stub = api_grpc.GenerationStub(channel)
            prompts = [list(stub.Tokenize(api_pb2.TokenizeRequest(text=t), timeout=TIMEOUT_S).token_ids) for t in texts]
    except grpc.RpcError as e:
        prompts = None
        result["checks"] += not_measured(f"{e.code().name}: {e.details()}")
    if prompts is not None:
        result["checks"] += measured_checks(bounds, client, where, info, prompts)
    result["checks"] += [check_memory(client, http), check_tokenizer(info, texts, prompts)]
    return result


def check_ready(client: Client, where: str, http: str | None) -> tuple[Check, ModelInfoResponse | None]:
    """The router's gRPC health (open without a key), its ModelInfo (needs the key) and, given the HTTP port,
    /health's answer -> (the check, ModelInfo or None where the API does not answer)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from blockspec.protos import api_grpc, api_pb2

    try:
        with client.channel(where) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            info = api_grpc.GenerationStub(channel).ModelInfo(api_pb2.ModelInfoRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        return Check("ready", "fail", f"gRPC {where}: {e.code().name}: {e.details()}"), None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    ok, parts = status == "SERVING", [f"gRPC health {status}"]
    if http is not None:
        try:
            code, body = client.get(http, "/health")
            ok, parts = ok and code == 200, parts + [f"/health {code} {body.strip()}"]
        except OSError as e:  # URLError is one
            ok, parts = False, parts + [f"/health at {http}: {getattr(e, 'reason', e)}"]
    return Check("ready", "pass" if ok else "fail", "; ".join(parts), {"grpc_health": status}), info


@dataclass(frozen=True)
class Passes:
    """The timed passes at concurrency 1: the median rows of speculative and plain decoding, every speculative
    pass's tokens (per prompt) and plain decoding's (the reference's, or this server's first pass)."""

    k: int
    spec: Row
    plain: Row
    spec_outputs: list[list[list[int]]]
    plain_outputs: list[list[int]]


def measure(client: Client, where: str, k: int, prompts: list[list[int]], max_tokens: int, rounds: int,
            reference: str | None) -> Passes:
    """Plain decoding and the server's default k, `rounds` passes each at concurrency 1, interleaved (bench
    --server's runner), then the reference's plain decoding of the same token ids, where one is given."""
    from blockspec.services.bench.modes import SERVER, Mode
    from blockspec.services.bench.run import against_plain, timed_passes
    from blockspec.services.bench.server import run_server_mode

    run = functools.partial(run_server_mode, prompts=prompts, max_tokens=max_tokens, concurrency=1,
                            connect=client.channel)
    modes = {Mode(SERVER.name, kk): functools.partial(run, where, kk) for kk in sorted({0, k})}
    passes = timed_passes(modes, rounds)
    against_plain(passes, plain=SERVER)
    (plain, plain_outputs), (spec, spec_outputs) = passes[SERVER], passes[Mode(SERVER.name, k)]
    reference_outputs = run(reference, 0)[1] if reference else plain_outputs[0]
    return Passes(k, spec, plain, spec_outputs, reference_outputs)


def measured_checks(bounds: Bounds, client: Client, where: str, info: ModelInfoResponse,
                    prompts: list[list[int]]) -> list[Check]:
    import grpc

    from blockspec.services.bench.server import ServerStreamError

    try:
        p = measure(client, where, info.default_speculative_tokens, prompts, bounds.max_tokens, bounds.rounds,
                    bounds.reference)
    except grpc.RpcError as e:
        return not_measured(f"{e.code().name}: {e.details()}")
    except ServerStreamError as e:
        return not_measured(str(e))
    return [check_identity(p, bounds.reference or "this server at k=0"), check_ratio(p, bounds.min_ratio),
            check_acceptance(p, bounds.min_acceptance), check_latency(p, bounds.max_ttft_ms, bounds.max_itl_ms)]


def not_measured(why: str) -> list[Check]:
    """The measured checks of a run whose passes failed: each fails, saying why."""
    return [Check(name, "fail", f"not measured: {why}") for name in MEASURED]


def first_difference(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, token index) of the first token where outputs and reference differ (a shorter output differs where
    it ends), or None."""
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        if got != want:
            return i, next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return None


def check_identity(p: Passes, source: str) -> Check:
    """Every speculative pass's tokens equal plain decoding's, prompt by prompt."""
    for n, outputs in enumerate(p.spec_outputs):
        where = first_difference(outputs, p.plain_outputs)
        if where is not None:
            i, t = where
            got, want = outputs[i][t:t + 1], p.plain_outputs[i][t:t + 1]
            return Check("identity", "fail", f"pass {n + 1}, prompt {i}, token {t}: {got or 'end'} at k={p.k}, "
                                             f"{want or 'end'} from plain decoding ({source})",
                         {"pass": n + 1, "prompt": i, "token": t})
    tokens = sum(map(len, p.plain_outputs))
    return Check("identity", "pass", f"every pass at k={p.k} ({len(p.spec_outputs)}) equals plain decoding's {tokens} "
                                     f"tokens ({source}), prompt by prompt", {"tokens": tokens})


def check_ratio(p: Passes, minimum: float) -> Check:
    figures = {"spec_tokens_per_s": p.spec.tokens_per_s, "plain_tokens_per_s": p.plain.tokens_per_s,
               "ratio": p.spec.speedup, "min_ratio": minimum, "k": p.k}
    detail = (f"{p.spec.tokens_per_s:.1f} tokens/s at k={p.k} vs {p.plain.tokens_per_s:.1f} plain: "
              f"{p.spec.speedup:.2f}x (at least {minimum:.2f}x)")
    drafted = p.spec.acceptance_rate is not None
    if not drafted:  # a server that does not speculate fails, whatever the timing noise made of its ratio
        detail += "; nothing drafted (k fell back to 0)" if p.k else "; the server's default k is 0"
    return Check("ratio", "pass" if drafted and p.spec.speedup >= minimum else "fail", detail, figures)


def check_acceptance(p: Passes, minimum: float) -> Check:
    rate = p.spec.acceptance_rate
    if rate is None:
        return Check("acceptance", "fail", f"nothing drafted at k={p.k} (the alert line: {minimum})", {"min": minimum})
    return Check("acceptance", "pass" if rate >= minimum else "fail",
                 f"{rate:.3f} accepted / drafted at k={p.k}, tau {p.spec.tau:.2f} (the alert line: {minimum})",
                 {"acceptance_rate": rate, "tau": p.spec.tau, "min": minimum})


def check_latency(p: Passes, max_ttft_ms: float | None, max_itl_ms: float | None) -> Check:
    """p99 TTFT and inter-token latency of the speculative passes (plain decoding's beside them): reported, and
    a check against the limits given."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    spec, plain = p.spec, p.plain
    over = []
    if max_ttft_ms is not None and (spec.ttft_p99_ms or 0) > max_ttft_ms:
        over.append(f"TTFT p99 over {max_ttft_ms:g} ms")
    if max_itl_ms is not None and (spec.itl_p99_ms or 0) > max_itl_ms:
        over.append(f"inter-token p99 over {max_itl_ms:g} ms")
    detail = (f"TTFT p99 {ms(spec.ttft_p99_ms)} ms, inter-token p99 {ms(spec.itl_p99_ms)} ms at k={p.k} (plain "
              f"{ms(plain.ttft_p99_ms)} / {ms(plain.itl_p99_ms)} ms)") + "".join(f"; {o}" for o in over)
    status = "fail" if over else "info" if max_ttft_ms is None and max_itl_ms is None else "pass"
    return Check("latency", status, detail, {"ttft_p99_ms": spec.ttft_p99_ms, "itl_p99_ms": spec.itl_p99_ms,
                                             "plain_ttft_p99_ms": plain.ttft_p99_ms,
                                             "plain_itl_p99_ms": plain.itl_p99_ms})


def role_memory(metrics: str) -> dict[str, dict[str, dict[str, float]]]:
    """{replica: {role: {kind: bytes}}} from the Prometheus text of /metrics (blockspec_role_memory_bytes)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples if family.name == "blockspec_role_memory_bytes" else ():
            out.setdefault(s.labels["replica"], {}).setdefault(s.labels["role"], {})[s.labels["kind"]] = s.value
    return out


def check_memory(client: Client, http: str | None) -> Check:
    """Each role's memory as the router last heard it (/metrics): reported."""
    if http is None:
        return Check("memory", "skip", "give --http HOST:PORT: the figures are on /metrics")
    try:
        status, body = client.get(http, "/metrics")
    except OSError as e:
        return Check("memory", "skip", f"/metrics at {http}: {getattr(e, 'reason', e)}")
    memory = role_memory(body) if status == 200 else {}
    if not memory:
        return Check("memory", "skip", f"/metrics ({status}) shows no blockspec_role_memory_bytes")

    def size(n: float) -> str:
        return f"{n / 2**20:.0f} MiB"

    detail = "; ".join(f"replica {r}: " + ", ".join(f"{role} {size(kinds.get('rss', 0))} RSS"
                                                     + (f" + {size(kinds['gpu'])} GPU" if kinds.get("gpu") else "")
                                                     for role, kinds in sorted(roles.items()))
                       for r, roles in sorted(memory.items()))
    return Check("memory", "info", detail, memory)


def check_tokenizer(info: ModelInfoResponse, texts: list[str], served: list[list[int]] | None) -> Check:
    """The served tokenizer is the target checkpoint's (the server's Tokenize against the checkpoint's own, its
    vocabulary size against ModelInfo's) and the drafter's ids are the target's - the start-up checks of `serve`,
    run again on the checkpoints ModelInfo names, where they are directories on this machine."""
    from blockspec.common.models.checkpoint import load_checkpoint

    target = Path(info.target)
    if not (target / "config.json").is_file():
        return Check("tokenizer", "skip", f"the target {info.target} is not a checkpoint directory on this machine")
    try:
        checkpoint = load_checkpoint(target, with_weights=False)
    except InvalidArgument as e:
        return Check("tokenizer", "fail", f"the target: {e}")
    problems = []
    if checkpoint.config.vocab_size != info.vocab_size:
        problems.append(f"the server's vocabulary {info.vocab_size}, the target's {checkpoint.config.vocab_size}")
    local = [checkpoint.tokenizer.encode(t) for t in texts]
    differs = [i for i, (a, b) in enumerate(zip(local, served or local, strict=True)) if a != b]
    if differs:
        problems.append(f"{len(differs)} prompts tokenize differently on the server (first: prompt {differs[0]})")
    drafter, drafter_problem = drafter_alignment(info, checkpoint)
    problems += [drafter_problem] if drafter_problem else []
    if problems:
        return Check("tokenizer", "fail", "; ".join(problems))
    checked = f"the server's tokens = the target's on {len(texts)} prompts" if served else "vocabulary sizes equal"
    if drafter is None:
        return Check("tokenizer", "skip", f"{checked}; the drafter {info.drafter} is not a checkpoint directory here")
    return Check("tokenizer", "pass", f"{checked}; {drafter}")


def drafter_alignment(info: ModelInfoResponse, target: Checkpoint) -> tuple[str | None, str | None]:
    """(what was checked, None) for a drafter whose ids are the target's, (None, None) where its checkpoint is not
    here to read, (None, the problem) for one whose are not."""
    from blockspec.common.models.checkpoint import check_same_tokenizer, load_checkpoint, read_config
    from blockspec.services.drafter.dflash import draft_vocab
    from blockspec.services.drafter.dflash.checkpoint import check_fits_target
    from blockspec.services.drafter.dflash.config import DFlashConfig

    if info.method in ("none", "ngram"):
        return f"{info.method}: drafts the context's own ids", None
    drafter = Path(info.drafter)
    if not (drafter / "config.json").is_file():
        return None, None
    vocab = target.config.vocab_size
    try:
        if info.method == "dflash":  # scores with the target's own embedding and LM head
            check_fits_target(DFlashConfig.from_hf(read_config(drafter), str(drafter)), target.config, str(drafter))
            ids = draft_vocab.load(drafter, vocab)
            rows = f"a draft vocabulary of {len(ids)} of its {vocab} ids" if ids is not None else f"all {vocab} ids"
            return f"dflash drafter on the target's embedding and LM head, {rows}", None
        check_same_tokenizer(target, load_checkpoint(drafter, with_weights=False))
        return f"draft_model tokenizer = the target's ({vocab} ids)", None
    except InvalidArgument as e:  # ModelLoadError is one
        return None, f"the drafter: {e}"
