"""`blockspec plan`: how a config's roles split a GPU (or a CPU machine's RAM), what the verifier's KV cache holds in
its share - tokens, requests at once at an average length, the longest context - and what to change where one request
of max_model_len does not fit; from the configs alone (no weights read, no GPU needed). The figures are the start-up
checks' own: the split from `device.MemorySplit`, the drafter's bytes from `startup.drafter_footprint`, the verifier's
parts from `footprint.verifier_layout` and its KV blocks by `device.kv_cache_blocks`' rule."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.common.config import MAX_BATCH, MIN_MODEL_LEN, BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint, read_config
from blockspec.common.runtime.device import DTYPES, drafter_fraction
from blockspec.common.runtime.footprint import STEP_RESERVE, parameters, verifier_layout

GIB, MIB, KIB = 2**30, 2**20, 2**10
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m)?\s*$", re.IGNORECASE)


def parse_size(text: str, field: str = "--gpu-memory") -> int:
    """'80GB' (10^9), '80GiB' or '80G' (2^30), '512MiB', or bytes -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise InvalidArgument(field, f"{text!r} is not a size: e.g. 80GB, 141GB, 80GiB or a number of bytes")
    unit = (m.group(2) or "").lower()
    scale = {"": 1, "gb": 10**9, "gib": GIB, "g": GIB, "mb": 10**6, "mib": 2**20, "m": 2**20}[unit]
    return int(float(m.group(1)) * scale)


@dataclass
class DrafterPlan:
    weights: int  # bytes
    kv: int  # its own KV cache: a slot of max_model_len for each of server.max_batch requests (a spare where captured)
    need: int
    share: int
    fraction: float
    fixed: bool  # the share is model.drafter_memory_fraction (else: the need with a margin)
    limit: int  # the replica's part of the memory: the drafter must leave the verifier some of it

    @property
    def fits(self) -> bool:
        return self.need <= self.share < self.limit


@dataclass
class Concurrency:
    length: int  # a request's average tokens
    at_max_batch: int  # requests at once at server.max_batch: the KV blocks' (at most max_batch)
    best: int  # requests at once with server.max_batch set to them (the drafter and the slots' states counted at it)


@dataclass
class VerifierPlan:
    role: str
    share: int  # bytes: the GPU x its fraction (0: the drafter leaves it nothing)
    fraction: float
    weights: int
    buffers: int  # the CUDA runner's captured steps' outputs, its spare slot's state and block
    slot: int  # a request slot's fixed state (a hybrid's conv and recurrent states, rollback inputs)
    slots: int  # server.max_batch
    kv_token: int  # bytes of one position's K/V, every attention layer
    tap_token: int  # bytes of one position's tap features (what the DFlash drafter reads)
    block_size: int
    num_blocks: int
    # "share": what the share leaves (a GPU); "kv_cache_tokens"; "slots": max_batch x max_model_len (the CPU);
    # "ranks": the tensor-parallel ranks' slot of max_model_len a request
    kv_from: str
    max_len: int
    longest: int  # the longest max_model_len one request of which fits (0: none)
    reserve: int = STEP_RESERVE  # kept free in the share for a step's intermediates

    @property
    def fixed(self) -> int:
        """Held whatever the KV cache's size: weights, buffers, the slots' states, and the step's reserve."""
        return self.weights + self.buffers + self.slots * self.slot + self.reserve

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def need(self) -> int:
        return self.fixed + self.num_blocks * self.block_size * (self.kv_token + self.tap_token)

    @property
    def fits(self) -> bool:
        return self.need <= self.share and self.kv_tokens >= self.max_len


@dataclass
class CapacityPlan:
    target: str
    family: str
    method: str
    dtype: str
    device: str  # "cuda": planned as on a GPU (the CUDA runner, captured drafts); "cpu": the CPU runner in RAM
    memory_bytes: int  # the GPU's memory, or the RAM
    memory: str  # where memory_bytes comes from
    utilization: float
    replicas: int
    graphs: bool  # the CUDA runner (its spare slot and captured outputs counted)
    verifier: VerifierPlan
    drafter: DrafterPlan | None
    concurrency: list[Concurrency]
    advice: list[str]

    @property
    def fits(self) -> bool:
        return self.verifier.fits and (self.drafter is None or self.drafter.fits)

    def table(self) -> str:
        return table(self)

    def to_json(self) -> dict:
        v = self.verifier
        return {**asdict(self), "fits": self.fits,
                "verifier": {**asdict(v), "fits": v.fits, "need": v.need, "kv_tokens": v.kv_tokens},
                "drafter": None if self.drafter is None else {**asdict(self.drafter), "fits": self.drafter.fits}}


def largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n) (fits monotone, true then false), or 0."""
    if high < low or not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def machine_memory(device: str) -> tuple[int, str]:
    """(bytes, where they come from) of this machine's memory for a config's model.device: a GPU's total (the server
    is its only tenant: gpu_memory_utilization leaves the headroom), or the RAM available now (psutil's `available`,
    what the processes already running leave, page cache counted free). InvalidArgument without the GPU it names."""
    if torch.device(device).type == "cpu":
        import psutil

        ram = psutil.virtual_memory()
        return ram.available, f"available now, of {ram.total / GIB:.1f} GiB: psutil"
    if not torch.cuda.is_available():
        raise InvalidArgument("--gpu-memory", "this machine has no GPU: give the card's memory, e.g. 80GB or 141GB")
    props = torch.cuda.get_device_properties(torch.device(device))
    return props.total_memory, f"this machine's {props.name}"


def plan_capacity(cfg: BlockspecConfig, memory_bytes: int, replicas: int = 1, device: str = "cuda",
                  memory: str = "given", lengths: tuple[int, ...] = ()) -> CapacityPlan:
    """The plan of a config (`startup.resolve_startup` resolves the method and the drafter as serving does) on
    `memory_bytes`: device "cuda" as on a GPU, whatever model.device says (the CUDA runner, the drafter's captured
    proposals, the KV cache sized from the share); "cpu" in RAM (the CPU runner, its KV cache max_batch requests of
    max_model_len), split between the roles as a GPU is, though nothing enforces it there. lengths: the average
    request lengths to count requests at once at (default: max_model_len and half of it)."""
    from blockspec.common.runtime.backends import uses_cuda_runner
    from blockspec.services.drafter.proposers import verifier_needs
    from blockspec.services.engine.engine import serving_len
    from blockspec.services.serving.startup import drafter_footprint, memory_split, resolve_startup

    m = cfg.model
    p = resolve_startup(cfg, replicas)
    dtype = DTYPES[m.dtype]
    target = load_checkpoint(m.target_model_path, with_weights=False).config
    max_len = serving_len(target.max_position_embeddings, m.max_model_len)
    slots, context = cfg.server.max_batch, target.max_position_embeddings
    graphs = uses_cuda_runner(target, torch.device(device), m.runner)
    dflash_cfg = None
    if p.method == "dflash":
        from blockspec.services.drafter.dflash.config import DFlashConfig

        dflash_cfg = DFlashConfig.from_hf(read_config(Path(p.drafter)), p.drafter)
    taps, _ = verifier_needs(p.method, dflash_cfg)
    foot = drafter_footprint(p.method, p.drafter, dtype, gpu=device == "cuda")
    weights = parameters(target).total * dtype.itemsize
    vocab = target.vocab_size * target.hidden_size * (1 if target.tie_word_embeddings else 2) * dtype.itemsize
    world = m.tensor_parallel_size  # the lead rank's part; the other ranks' is smaller
    paged = world == 1  # the tensor-parallel ranks keep a slot of max_len a request
    kv_from = ("ranks" if not paged else "kv_cache_tokens" if m.kv_cache_tokens else "share" if device == "cuda"
               else "slots")

    def shares(n: int, length: int) -> tuple[float, float]:
        """(verifier, drafter) fractions at max_batch n and max_model_len `length`; verifier 0 where none is left."""
        split = memory_split(m, foot, n, length, replicas)
        try:
            return split.fractions(memory_bytes)
        except InvalidArgument:  # the drafter's share is all of it, or more
            fixed = split.drafter_fixed
            return 0.0, drafter_fraction(split.drafter_need, memory_bytes) if fixed is None else fixed

    def layout(n: int):
        return verifier_layout(target, weights, n, len(taps), dtype, m.kv_block_size, graphs, world, vocab, max_len)

    fixed_blocks = -(-m.kv_cache_tokens // m.kv_block_size) if kv_from == "kv_cache_tokens" else 0

    def fits(n: int, requests: int, length: int, max_model_len: int) -> bool:
        """Whether `requests` requests of `length` tokens fit at max_batch n and max_model_len, in the KV blocks serving
        would take: what they take (sized from the share), model.kv_cache_tokens', or a slot of max_model_len each."""
        lay = layout(n)
        blocks = requests * lay.blocks_for(length)
        if kv_from == "kv_cache_tokens":
            blocks = fixed_blocks if blocks <= fixed_blocks else None
        elif kv_from in ("slots", "ranks"):
            blocks = n * lay.blocks_for(max_model_len)
        return blocks is not None and lay.held(blocks) + STEP_RESERVE <= int(memory_bytes * shares(n, max_model_len)[0])

    fraction, d_fraction = shares(slots, max_len)
    share, lay = int(memory_bytes * fraction), layout(slots)
    num_blocks = {"share": lay.blocks_in(share), "kv_cache_tokens": fixed_blocks}.get(kv_from,
                                                                                      slots * lay.blocks_for(max_len))
    longest = largest(lambda n: fits(slots, 1, n, n), MIN_MODEL_LEN, context)
    name = "verifier" if world == 1 else f"verifier (rank 0 of {world})"
    per_block = (lay.kv_block // lay.block_size, lay.tap_block // lay.block_size)
    verifier = VerifierPlan(name, share, fraction, lay.weights, lay.buffers, lay.slot, slots, *per_block,
                            lay.block_size, num_blocks, kv_from, max_len, longest)
    drafter = None
    if foot is not None:
        need = foot.bytes(slots, max_len, dtype)
        drafter = DrafterPlan(foot.weights, need - foot.weights, need, int(memory_bytes * d_fraction),
                              d_fraction, m.drafter_memory_fraction is not None,
                              int(memory_bytes * m.gpu_memory_utilization / replicas))
    concurrency = []
    for length in sorted(set(lengths or (max_len, max_len // 2)), reverse=True):
        per = lay.blocks_for(length if kv_from in ("share", "kv_cache_tokens") else max_len)
        concurrency.append(Concurrency(length, min(slots, num_blocks // per),
                                       largest(lambda n: fits(n, n, length, max_len), 1, MAX_BATCH)))
    plan = CapacityPlan(str(m.target_model_path), target.family, p.method, m.dtype, device, memory_bytes, memory,
                        m.gpu_memory_utilization, replicas, graphs, verifier, drafter, concurrency, [])
    plan.advice = advice(plan, lambda n: fits(n, 1, max_len, max_len))
    return plan


def advice(plan: CapacityPlan, fits_at) -> list[str]:
    """What to change for each role that does not fit; fits_at(n): whether a request of max_model_len fits at
    server.max_batch n."""
    from blockspec.common.runtime.device import DRAFTER_MARGIN, DRAFTER_SLACK

    out, v, d = [], plan.verifier, plan.drafter
    where = "GPU" if plan.device == "cuda" else "machine"
    if d is not None and d.need > d.share:
        needed = (d.need * (1 + DRAFTER_MARGIN) + DRAFTER_SLACK) / plan.memory_bytes
        out.append(f"drafter: needs {d.need / GIB:.2f} GiB of its {d.share / GIB:.2f} GiB share "
                   f"(model.drafter_memory_fraction {d.fraction}); raise it to {needed:.3f} or unset it (its share "
                   "is then what it holds)")
    if v.fits:
        return out
    block = v.block_size * (v.kv_token + v.tap_token)
    room = max(0, v.share - v.fixed) // block * v.block_size  # the tokens its share holds
    options = [f"model.max_model_len {v.longest} (at max_batch {v.slots})"] if v.longest else []
    fewer = largest(fits_at, 1, v.slots - 1)
    options += [f"server.max_batch {fewer}"] if fewer else []
    options += [f"model.kv_cache_tokens {room}"] if v.kv_from == "slots" and room >= v.max_len else []
    lower = f"lower to {' or '.join(options)}, or " if options else ""
    if not room:
        held = (f"the drafter's share ({d.share / GIB:.2f} GiB) leaves it {v.share / GIB:.2f} GiB"
                if d is not None and not v.share else f"its share is {v.share / GIB:.2f} GiB")
        out.append(f"{v.role}: no KV cache fits: {held}, and its weights, states, buffers and step reserve are "
                   f"{v.fixed / GIB:.2f} GiB; {lower}a {where} with more memory, a raised gpu_memory_utilization, "
                   f"fewer replicas on the {where}")
        return out
    asked = max(v.kv_tokens, v.max_len)
    need = v.fixed + asked * (v.kv_token + v.tap_token)
    out.append(f"{v.role}: {asked} KV cache tokens (max_model_len {v.max_len}) and {v.fixed / GIB:.2f} GiB of weights, "
               f"states, buffers and step reserve need {need / GIB:.2f} GiB; its "
               f"{v.share / GIB:.2f} GiB share holds {room} tokens; {lower}raise model.gpu_memory_utilization")
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def table(plan: CapacityPlan) -> str:
    """The plan as text: the split, the verifier's arithmetic, requests at once, the longest context, the verdict."""
    v, d = plan.verifier, plan.drafter
    notes = (["the CUDA runner"] if plan.graphs else []) + (
        ["the roles' shares as on a GPU (nothing enforces them on the CPU)"] if plan.device == "cpu" else [])
    lines = [f"Target {plan.target} ({plan.family}), method {plan.method}, {plan.dtype}; "
             f"{'GPU' if plan.device == 'cuda' else 'RAM'} {plan.memory_bytes / GIB:.1f} GiB ({plan.memory}), "
             f"gpu_memory_utilization {plan.utilization}, {plan.replicas} replica(s) on it"
             + "".join(f"; {note}" for note in notes), ""]
    usable = plan.memory_bytes * plan.utilization / plan.replicas
    split = f"{plan.utilization} x {plan.memory_bytes / GIB:.1f} GiB" + (
        f" / {plan.replicas} replicas" if plan.replicas > 1 else "") + f" = {usable / GIB:.2f} GiB"
    if d is not None:
        why = "model.drafter_memory_fraction" if d.fixed else "what it holds, with a margin"
        lines.append(f"Split: {split}; the drafter {_gib(d.share)} ({d.fraction} of the memory: {why}), the "
                     f"verifier the rest, {_gib(v.share)}.")
        lines.append(f"Drafter: {_gib(d.weights)} of weights + {_gib(d.kv)} of KV cache (a slot of {v.max_len} tokens "
                     f"for each of {v.slots} requests{', and a spare' if plan.device == 'cuda' else ''}) = "
                     f"{_gib(d.need)}: {'fits' if d.fits else 'does not fit'}.")
    else:
        lines.append(f"Split: {split}, all the verifier's (no drafter model).")
    block = v.block_size * (v.kv_token + v.tap_token)
    cache = {"share": "what its share leaves", "kv_cache_tokens": "model.kv_cache_tokens",
             "slots": f"{v.slots} requests of {v.max_len}",
             "ranks": f"{v.slots} requests of {v.max_len}: the ranks keep a slot of it a request"}[v.kv_from]
    lines += [f"{v.role.capitalize()}: {_gib(v.share)} - {_gib(v.weights)} of weights - {_gib(v.buffers)} of buffers"
              f" - {_gib(v.slots * v.slot)} of states ({v.slots} slots of {v.slot / MIB:.1f} MiB) - "
              f"{_gib(v.reserve)} kept for a step's intermediates = "
              f"{_gib(max(0, v.share - v.fixed))} for KV blocks;",
              f"  a block of {v.block_size} tokens is {block / MIB:.2f} MiB (a token: {v.kv_token / KIB:.1f} KiB of "
              f"K/V + {v.tap_token / KIB:.1f} KiB of tap features); its KV cache ({cache}): {v.num_blocks} blocks = "
              f"{v.kv_tokens} tokens, {_gib(v.num_blocks * block)}.", "",
              f"| average request length | requests at once at max_batch {v.slots} | with server.max_batch set to "
              "them |", "|---|---|---|"]
    lines += [f"| {c.length} | {c.at_max_batch} | {c.best} |" for c in plan.concurrency]
    fits = "fits" if v.kv_tokens >= v.max_len else f"does not fit: {v.kv_tokens} tokens do"
    whole = f"{v.slots} requests of it" if v.kv_from in ("slots", "ranks") else "one request"
    lines += ["", f"Longest context: max_model_len {v.longest or '-'} ({whole}); max_model_len {v.max_len}: {fits}.",
              ""]
    return "\n".join(lines + (plan.advice or ["Every role fits."]))
