"""The user-facing config.yaml schema, validated in one place: every error names the key, the value
and what is allowed. Components receive only their own section."""

from __future__ import annotations

import collections.abc
import hashlib
import re
import reprlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from blockspec.common.argtypes import check_device_name
from blockspec.common.errors import InvalidArgument
from blockspec.common.tokens.prefix_hash import BLOCK_TOKENS
from blockspec.common.wire.auth import DEFAULT_TENANT, ApiKeys

# Bounds the command line's flags of the same names share (services/cli.py).
MAX_BATCH = 1024  # server.max_batch: requests stepped together per replica
MIN_MODEL_LEN = 16  # model.max_model_len
MAX_LOOKUP_TOKENS = 48  # model.spec_decode.prompt_lookup_tokens
DEFAULT_K = 5  # draft tokens per step where neither the request nor model.spec_decode.num_speculative_tokens says
DEFAULT_MAX_LEN = 4096  # tokens per request (KV cache per slot) when the model's context is longer

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RateLimit(_Section):
    """A tenant's budgets (None: unlimited); each bucket holds its period's worth and refills evenly."""

    requests_per_minute: int | None = Field(None, ge=1, description="Generate calls a minute (unset: unlimited)")
    tokens_per_minute: int | None = Field(None, ge=1, description=(
        "prompt + max_tokens a minute, reserved at admission; what a request does not use is refunded"))
    tokens_per_day: int | None = Field(None, ge=1, description="the same tokens over a rolling day: a quota")


class RateLimits(RateLimit):
    """server.rate_limit: the limits of every tenant (an API key's, or "default" without keys), and `tenants`
    where one has its own."""

    tenants: dict[str, RateLimit] = Field(default_factory=dict, description=(
        "per tenant (a name from server.api_keys_file), the keys above for that tenant instead"))


class TlsConfig(_Section):
    """server.tls: HTTPS and gRPC over TLS on the public ports; the files are read again when they change."""

    cert_file: str = Field(description="PEM certificate chain the ports present (the server's first)")
    key_file: str = Field(description="PEM private key of that certificate")
    client_ca_file: str | None = Field(None, description=(
        "mutual TLS: every client must present a certificate this CA (PEM) signed; unset: any client"))
    min_version: Literal["1.2", "1.3"] = Field("1.2", description=(
        "oldest TLS version the HTTP port accepts (the gRPC port's is 1.2, gRPC's own floor)"))

    @model_validator(mode="after")
    def _loads(self) -> TlsConfig:
        from blockspec.common.wire.tls import ServerTls

        ServerTls(self.cert_file, self.key_file, self.client_ca_file, self.min_version)  # names the file at fault
        return self


class RoleTlsConfig(_Section):
    """server.role_tls: mutual TLS on the router's hops to roles over TCP (Unix sockets stay plaintext)."""

    cert_file: str = Field(description="PEM certificate every role presents, and the router as their client")
    key_file: str = Field(description="PEM private key of that certificate")
    ca_file: str = Field(description="PEM CA that signed it: each side accepts only a peer it signed")

    @model_validator(mode="after")
    def _loads(self) -> RoleTlsConfig:
        from blockspec.common.wire.tls import ServerTls

        ServerTls(self.cert_file, self.key_file, self.ca_file, field="server.role_tls")
        return self


class AutoscalingConfig(_Section):
    """server.autoscaling: replicas that follow the queue (services/router/autoscale.py); server.replicas is the
    count at start."""

    min_replicas: int = Field(1, ge=1, le=64, description="replicas kept however short the queue")
    max_replicas: int = Field(1, ge=1, le=64, description="replicas at most, however long the queue")
    target_waiting_per_replica: float = Field(2.0, gt=0, description=(
        "requests waiting for a slot per replica that the replica count aims at"))
    scale_up_delay_s: float = Field(10.0, ge=0, description="the queue asks for more replicas this long before one starts")
    scale_down_delay_s: float = Field(120.0, ge=0, description=(
        "the queue asks for fewer this long before one replica drains (its streams finish) and stops"))

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class RoutingConfig(_Section):
    """server.routing: which replica a new request goes to (services/router/prefix_routing.py)."""

    policy: Literal["prefix", "least_loaded"] = Field("prefix", description=(
        "prefix: the replica that was sent the prompt's leading KV blocks (its prefix cache skips their prefill), "
        "unless it is overloaded; least_loaded: the replica holding the fewest requests"))
    cache_threshold: float = Field(0.3, ge=0, le=1, description=(
        "prefix: the share of the prompt's full blocks a replica must hold to take it for its cache"))
    balance_abs_threshold: int = Field(4, ge=0, description=(
        "prefix: a replica holding more than this many requests over the least loaded one, and more than "
        "balance_rel_threshold times as many, is skipped"))
    balance_rel_threshold: float = Field(1.5, ge=1, description="prefix: the relative half of that test")


class AdminConfig(_Section):
    """server.admin: the management address (blue/green rollouts: `blockspec rollout`, docs/operations.md#rollouts).
    Only a caller with the admin key is served there."""

    host: str = Field("127.0.0.1", description="address the management port binds (keep it off the public network)")
    port: int = Field(8002, ge=0, le=65535, description="the management HTTP port; 0: any free port (printed)")
    key_file: str = Field(description="the admin key: one line, at least 16 characters (`Authorization: Bearer KEY`)")
    rollout_grace_s: float = Field(600.0, ge=0, description=(
        "after a promote, the old version runs this long (streams finish, a rollback is a switch), then stops"))
    check_prompts: int = Field(4, ge=1, le=64, description=(
        "a new version's go-live checks run this many of the check prompts (speculative == plain, the ratio)"))
    check_max_tokens: int = Field(64, ge=1, description="new tokens per check request")
    check_prompts_file: str | None = Field(None, description=(
        "one prompt a line (.jsonl: a JSON string each); unset: the shipped pair's held-out prompts"))
    min_speedup: float = Field(0.0, ge=0, description=(
        "speculative over plain tokens/s at concurrency 1 a new version must reach to be promoted (0: measured, not "
        "required)"))


class ServerConfig(_Section):
    host: str = Field("0.0.0.0", description="address the HTTP and gRPC ports bind")
    port: int = Field(8000, ge=0, le=65535, description="HTTP: /health, /metrics, /v1; 0: any free port (printed)")
    grpc_port: int = Field(8001, ge=0, le=65535, description="the public gRPC API; 0: any free port (printed)")
    workers: int = Field(1, ge=1, description="router processes per server (1); scale out with server.replicas")
    max_batch: int = Field(16, ge=1, le=MAX_BATCH, description="requests stepped together per replica (KV cache slots)")
    replicas: int = Field(1, ge=1, le=64, description="verifier + drafter pairs, each its own placement group on Ray")
    prefill_chunk_tokens: int = Field(512, ge=1, description=(
        "prompt tokens prefilled per step, so that a long prompt never stalls the running streams"))
    unix_sockets: bool = Field(True, description=(
        "the router reaches roles on its own host over Unix domain sockets (false: TCP)"))
    api_keys_file: str | None = Field(None, description=(
        "API keys, `KEY` or `TENANT KEY` a line; unset: no key is needed (docs/operations.md)"))
    rate_limit: RateLimits = Field(default_factory=RateLimits, description=(
        "the budgets of every tenant, and of named tenants"))
    routing: RoutingConfig = Field(RoutingConfig(), description=(
        "which replica takes a new request: by prompt prefix, within load bounds, or the least loaded"))
    autoscaling: AutoscalingConfig | None = Field(None, description=(
        "replicas that follow the queue, between min and max (unset: server.replicas, fixed)"))
    tls: TlsConfig | None = Field(None, description="TLS on the HTTP and gRPC ports (unset: plaintext)")
    role_tls: RoleTlsConfig | None = Field(None, description=(
        "mutual TLS between the router and its roles over TCP (unset: plaintext, with the role key)"))
    admin: AdminConfig | None = Field(None, description=(
        "the management port: blue/green rollouts of a new model version (unset: none)"))

    @field_validator("api_keys_file")
    @classmethod
    def _keys_load(cls, value: str | None) -> str | None:
        if value is not None:
            ApiKeys.load(value)  # its ValueError names the line; the config's error names the key
        return value

    @model_validator(mode="after")
    def _limited_tenants_exist(self) -> ServerConfig:
        """A tenant under rate_limit.tenants that no key names would silently get nothing: refused."""
        known = ApiKeys.load(self.api_keys_file).tenants if self.api_keys_file else frozenset({DEFAULT_TENANT})
        unknown = sorted(set(self.rate_limit.tenants) - known)
        if unknown:
            where = (f"in {self.api_keys_file}" if self.api_keys_file
                     else f"without server.api_keys_file (every caller is {DEFAULT_TENANT!r})")
            raise ValueError(f"rate_limit.tenants {unknown}: no such tenant {where}; known: {sorted(known)}")
        return self

    @model_validator(mode="after")
    def _replicas_in_bounds(self) -> ServerConfig:
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(f"replicas {self.replicas}: the count at start must lie in autoscaling's "
                             f"[{a.min_replicas}, {a.max_replicas}]")
        return self

    @field_validator("workers")
    @classmethod
    def _one_worker(cls, value: int) -> int:
        if value != 1:
            raise ValueError("one router worker per server is supported; use 1 and scale with server.replicas")
        return value


class SpecDecodeConfig(_Section):
    enabled: bool = Field(True, description="false: plain decoding, no drafter is started")
    method: Literal["dflash", "draft_model", "ngram"] | None = Field(None, description=(
        "unset: dflash for a DFlash checkpoint, draft_model for another drafter, ngram without one"))
    num_speculative_tokens: int = Field(DEFAULT_K, ge=1, le=16, description=(
        "k, the draft tokens per step of a request that does not set its own (dflash: at most block_size - 1)"))
    draft_model_dtype: Literal["float32", "float16", "bfloat16"] = Field("bfloat16", description=(
        "accepted for compatibility; the drafter runs in model.dtype (it reads the target's tensors in place), and a "
        "value set here that differs is said in the log"))
    use_dynamic_conv: bool = Field(True, description="dflash: the drafter's two-tap dynamic convolution")
    use_path_selector: bool = Field(True, description="dflash: the drafter's pairwise path selector")
    adaptive_k: bool = Field(False, description=(
        "choose k each step from measured costs and acceptance (at most num_speculative_tokens; 0 where drafting "
        "does not pay)"))
    prompt_lookup: bool = Field(False, description=(
        "draft a repeat of the context by n-gram lookup; the drafter drafts the other requests"))
    prompt_lookup_tokens: int | None = Field(None, ge=1, le=MAX_LOOKUP_TOKENS, description=(
        "a lookup's draft tokens when a request runs alone (unset: k); needs prompt_lookup"))
    draft_tree: list[int] = Field(default_factory=list, description=(
        "dflash: draft a tree verified in one forward, its children per node at each depth, 1..16 each ([3]: three "
        "first tokens, each continued by one path; [2, 2]); empty: one path. serve --inprocess, a target of "
        "attention layers, the eager runner (docs/sampling.md#draft-trees)"))

    @field_validator("draft_tree")
    @classmethod
    def _tree_counts(cls, value: list[int]) -> list[int]:
        if any(not 1 <= n <= 16 for n in value):
            raise ValueError(f"{value}: children per node must be 1..16")
        return value


VERSION_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}"


class ModelSection(_Section):
    version: str | None = Field(None, pattern=f"^{VERSION_NAME}$", description=(
        "this model version's name, on every response, metric and trace; unset: the target directory's name and a "
        "hash of this section"))
    target_model_path: str = Field(description="the target's checkpoint directory (config.json, weights, tokenizer)")
    draft_model_path: str | None = Field(None, description=(
        "the drafter's checkpoint directory (a DFlash drafter or a small causal LM); unset: ngram"))
    spec_decode: SpecDecodeConfig = Field(SpecDecodeConfig(), description="how the drafter drafts")
    tensor_parallel_size: int = Field(1, ge=1, le=8, description=(
        "ranks the target is split over (dense, hybrid and MoE targets; docs/operations.md#tensor-parallelism): "
        "on CUDA one GPU each, from the device's index on; on the CPU processes"))
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description=(
        "share of each GPU's memory the roles may hold: the drafter's part is what it holds, the verifier's the rest "
        "(docs/operations.md#memory-planning)"))
    drafter_memory_fraction: float | None = Field(None, gt=0.0, lt=1.0, description=(
        "each replica's drafter role's share of a GPU's memory, out of gpu_memory_utilization; unset: what it holds "
        "(weights, its KV cache for server.max_batch requests of max_model_len, captured steps) with a margin"))
    max_model_len: int | None = Field(None, ge=MIN_MODEL_LEN, description=(
        f"the longest request in tokens (prompt and output); unset: the model's context, at most {DEFAULT_MAX_LEN}"))
    kv_cache_tokens: int | None = Field(None, ge=MIN_MODEL_LEN, description=(
        "positions the verifier's paged KV cache holds, shared by its requests; unset: on a GPU what its memory share "
        "leaves, on the CPU server.max_batch x max_model_len"))
    kv_block_size: int = Field(BLOCK_TOKENS, ge=1, le=1024, description=(
        "positions a KV cache block holds (a power of two): the unit a request takes, and a cached prefix's"))
    prefix_caching: bool = Field(True, description=(
        "a prompt starts from the cached KV blocks of an earlier one with the same leading tokens (and tenant)"))
    device: str = Field("cpu", description="both roles of a replica: cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description=(
        "target and drafter (the drafter reads the target's tensors)"))
    invariant: bool = Field(False, description=(
        "decode with the verify query width, so that bf16 output stays token-identical on the eager runner "
        "(docs/exactness.md)"))
    runner: Literal["auto", "eager", "graphs"] = Field("auto", description=(
        "the target's runner: auto (the CUDA runner's captured steps on CUDA, the eager runner elsewhere), eager, or "
        "graphs (docs/gpu.md)"))

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        try:
            return check_device_name(value, "model.device")
        except InvalidArgument as e:
            raise ValueError(e.message) from None

    @field_validator("kv_block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("a power of two (a position's block and offset are a shift and a mask)")
        return value

    @model_validator(mode="after")
    def _ranks_on_devices(self) -> ModelSection:
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} with tensor_parallel_size {self.tensor_parallel_size}: the ranks "
                             "take cuda:0 to cuda:N-1; use 'cuda' (CUDA_VISIBLE_DEVICES picks the GPUs)")
        return self


class BlockspecConfig(_Section):
    server: ServerConfig = Field(ServerConfig(), description="the router's ports, batching, replicas, keys and limits")
    model: ModelSection = Field(description="the target, the drafter and how they run")

    @property
    def version(self) -> str:
        """The serving version's name: model.version, else the target directory's name and 8 hex digits of the model
        section (another checkpoint path or setting: another name)."""
        if self.model.version:
            return self.model.version
        digest = hashlib.sha256(self.model.model_dump_json().encode()).hexdigest()[:8]
        name = re.sub(r"[^A-Za-z0-9._-]", "-", Path(self.model.target_model_path.rstrip("/")).name)[:40].lstrip("._-")
        return f"{name or 'model'}-{digest}"


_SHORT = reprlib.Repr()  # a value in one line, however big (YAML aliases can make a short file a huge value)
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlist = _SHORT.maxdict = 6
_SHORT.maxlevel = 2


def _describe(error: dict) -> str:
    key = ".".join(str(p) for p in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if error["type"] == "missing":
        return f"{key}: required key is missing"
    msg = error["msg"].removeprefix("Value error, ")
    return f"{key}: {_SHORT.repr(error.get('input'))} is not allowed: {msg}"


def parse_config(raw: object, source: str = "config") -> BlockspecConfig:
    """Validate a parsed YAML document; raises InvalidArgument listing every problem."""
    if raw is None:  # an empty file, or only comments
        raise InvalidArgument(source, "empty: expected a mapping at the top level (at least model.target_model_path)")
    if not isinstance(raw, dict):
        raise InvalidArgument(source, f"expected a mapping at the top level, got {type(raw).__name__}")
    try:
        cfg = BlockspecConfig.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err) for err in e.errors()]
        raise InvalidArgument(source, "; ".join(problems)) from None
    check_ports(cfg.server.port, cfg.server.grpc_port)
    return cfg


def check_ports(port: int, grpc_port: int, field: str = "server.grpc_port") -> None:
    """HTTP and gRPC each need their own port (0: any free one)."""
    if port and port == grpc_port:
        raise InvalidArgument(field, f"{grpc_port} is not allowed: must differ from the HTTP port ({port})")


_MERGE = object()  # a `<<` key: one a mapping


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one, silently). Checked as each
    mapping is flattened, merge sources included, before PyYAML writes their keys into it; a merged key that the
    mapping overrides is fine."""

    def flatten_mapping(self, node) -> None:
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:  # an aliased mapping is flattened once, in place
            checked.add(id(node))
            seen = set()
            for key_node, _ in node.value:
                key = _MERGE if key_node.tag == "tag:yaml.org,2002:merge" else self.construct_object(key_node, deep=True)
                if isinstance(key, collections.abc.Hashable):  # an unhashable one: the base class names it
                    if key in seen:
                        name = "<<" if key is _MERGE else repr(key)
                        raise yaml.constructor.ConstructorError(None, None, f"key {name} appears twice in one mapping",
                                                                key_node.start_mark)
                    seen.add(key)
        super().flatten_mapping(node)


def load_config(path: str | Path) -> BlockspecConfig:
    p = Path(path)
    if p.is_dir():
        raise InvalidArgument(str(p), "is a directory: give the config file (YAML) itself")
    if not p.is_file():
        raise InvalidArgument(str(p), "config file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise InvalidArgument(str(p), f"cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise InvalidArgument(str(p), f"not UTF-8 text (byte {e.start})") from None
    return parse_config(load_yaml(text, str(p)), str(p))


def load_yaml(text: str, source: str) -> object:
    """A YAML document (a key given twice in one mapping refused); errors name `source`, what is wrong and where."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise InvalidArgument(source, "nested too deeply") from None
    except yaml.YAMLError as e:  # one line: what is wrong and where
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise InvalidArgument(source, f"not valid YAML: {getattr(e, 'problem', None) or e}{where}") from None
