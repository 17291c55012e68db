"""`blockspec plan`: whether a config's roles fit their shares of a GPU (or of a CPU machine's RAM), and what to lower
where they do not, from the configs alone (no weights read, no GPU needed). The figures are the start-up checks' own:
each role's bytes come from `footprint.verifier_bytes` / `footprint.drafter_bytes` (what `Verifier.static_bytes` and
the drafter role count before they allocate), its share from `device.role_fractions`, the verdict from
`device.check_fits`' rule."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.common.config import MIN_MODEL_LEN, BlockspecConfig
from blockspec.common.errors import InvalidArgument
from blockspec.common.models.checkpoint import load_checkpoint, read_config
from blockspec.common.models.kv_cache import SlotKVCache
from blockspec.common.runtime.device import DTYPES, role_fractions
from blockspec.common.runtime.footprint import drafter_bytes, parameters, slot_bytes, verifier_bytes

GIB = 2**30
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
class RolePlan:
    role: str
    weights: int  # bytes
    per_slot: int  # bytes of one request slot at max_len (KV cache, states, tap features)
    slots: int
    max_len: int
    need: int  # what the start-up check counts
    share: int  # its part of the GPU: gpu bytes x its fraction
    fraction: float
    max_slots: int  # slots that fit at max_len (0: not even one)
    longest: int  # the longest max_model_len that fits `slots` slots (0: none)

    @property
    def fits(self) -> bool:
        return self.need <= self.share


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
    roles: list[RolePlan]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.roles)

    def advice(self) -> list[str]:
        """What to lower (or raise) for each role that does not fit."""
        out = []
        for r in self.roles:
            if r.fits:
                continue
            if r.weights > r.share:
                where = "GPU" if self.device == "cuda" else "machine"
                out.append(f"{r.role}: its weights alone ({r.weights / GIB:.1f} GiB) exceed its share "
                           f"({r.share / GIB:.1f} GiB): a {where} with more memory, a raised gpu_memory_utilization, "
                           f"or fewer replicas on the {where}")
                continue
            options = []
            if r.max_slots:
                options.append(f"server.max_batch {r.max_slots} (at max_model_len {r.max_len})")
            if r.longest:
                options.append(f"model.max_model_len {r.longest} (at max_batch {r.slots})")
            needed = r.need / (self.memory_bytes * r.fraction / self.utilization) if r.fraction else float("inf")
            if needed <= 1.0:
                options.append(f"model.gpu_memory_utilization {min(1.0, needed + 0.005):.2f}")
            out.append(f"{r.role}: needs {r.need / GIB:.2f} GiB of its {r.share / GIB:.2f} GiB share; lower to "
                       + (" or ".join(options) if options else "a smaller configuration"))
        return out

    def table(self) -> str:
        notes = (["the CUDA runner"] if self.graphs else []) + (
            ["the roles' shares as on a GPU (nothing enforces them on the CPU)"] if self.device == "cpu" else [])
        head = (f"Target {self.target} ({self.family}), method {self.method}, {self.dtype}; "
                f"{'GPU' if self.device == 'cuda' else 'RAM'} {self.memory_bytes / GIB:.1f} GiB ({self.memory}), "
                f"gpu_memory_utilization {self.utilization}, {self.replicas} replica(s) on it"
                + "".join(f"; {note}" for note in notes))
        columns = ("| role | weights GiB | per slot MiB | slots | max_model_len | needs GiB | share GiB | fits | "
                   "slots that fit | longest context at these slots |")
        lines = [head, "", columns, "|---" * 10 + "|"]
        for r in self.roles:
            lines.append(f"| {r.role} | {r.weights / GIB:.2f} | {r.per_slot / 2**20:.1f} | {r.slots} | {r.max_len} | "
                         f"{r.need / GIB:.2f} | {r.share / GIB:.2f} | {'yes' if r.fits else 'no'} | {r.max_slots} | "
                         f"{r.longest or '-'} |")
        return "\n".join(lines + [""] + (self.advice() or ["Every role fits."]))

    def to_json(self) -> dict:
        return {**asdict(self), "fits": self.fits, "advice": self.advice(),
                "roles": [{**asdict(r), "fits": r.fits} for r in self.roles]}


def _largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n) (fits monotone, true then false), or 0."""
    if high < low or not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _role(role: str, weights: int, per_slot: int, need_at, slots: int, max_len: int, limit: int, share: int,
          fraction: float) -> RolePlan:
    """need_at(slots, max_len) -> bytes; limit: the model's context (the longest max_model_len there is)."""
    return RolePlan(role, weights, per_slot, slots, max_len, need_at(slots, max_len), share, fraction,
                    _largest(lambda s: need_at(s, max_len) <= share, 1, 4096),
                    _largest(lambda n: need_at(slots, n) <= share, MIN_MODEL_LEN, limit))


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
                  memory: str = "given") -> CapacityPlan:
    """The plan of a config (`plan.plan` resolves the method and the drafter as serving does) on `memory_bytes`:
    device "cuda" as on a GPU, whatever model.device says (the CUDA runner, the drafter's captured proposals); "cpu"
    in RAM (the CPU runner), split between the roles as a GPU is, though nothing enforces it there."""
    from blockspec.common.runtime.backends import uses_cuda_runner
    from blockspec.services.drafter.proposers import verifier_needs
    from blockspec.services.engine.engine import serving_len
    from blockspec.services.serving.startup import resolve_startup

    m = cfg.model
    p = resolve_startup(cfg, replicas)
    dtype = DTYPES[m.dtype]
    target = load_checkpoint(m.target_model_path, with_weights=False).config
    max_len = serving_len(target.max_position_embeddings, m.max_model_len)
    slots = cfg.server.max_batch
    graphs = uses_cuda_runner(target, torch.device(device), m.runner)
    dflash_cfg, drafter_weights, drafter_shape = None, 0, None
    if p.method == "dflash":
        from blockspec.services.drafter.dflash.config import DFlashConfig
        from blockspec.services.drafter.dflash.model import DFlashDrafter

        dflash_cfg = DFlashConfig.from_hf(read_config(Path(p.drafter)), p.drafter)
        with torch.device("meta"):
            drafter_weights = sum(t.numel() for t in DFlashDrafter(dflash_cfg).parameters()) * dtype.itemsize
        drafter_shape = (dflash_cfg.num_layers, dflash_cfg.num_kv_heads, dflash_cfg.head_dim)
    elif p.method == "draft_model":
        draft = load_checkpoint(p.drafter, with_weights=False).config
        drafter_weights = parameters(draft).total * dtype.itemsize
        drafter_shape = (draft.num_layers, draft.num_kv_heads, draft.head_dim)
    taps, _ = verifier_needs(p.method, dflash_cfg)
    verifier_fraction, drafter_fraction = role_fractions(m.gpu_memory_utilization, p.method != "none", replicas)
    weights = parameters(target).total * dtype.itemsize
    vocab = target.vocab_size * target.hidden_size * (1 if target.tie_word_embeddings else 2) * dtype.itemsize
    world = m.tensor_parallel_size  # the lead rank's part; the other ranks' is smaller

    def verifier_need(s: int, n: int) -> int:
        return verifier_bytes(target, weights, s, n, len(taps), dtype, graphs, world, vocab)

    per_slot, held, name = sum(slot_bytes(target, max_len, dtype, len(taps)).values()), weights, "verifier"
    if world > 1:  # the lead rank's part, on the GPU it shares with the drafter
        name = f"verifier (rank 0 of {world})"
        held = (weights - vocab) // world + vocab
        per_slot = (verifier_bytes(target, weights, 1, max_len, len(taps), dtype, False, world, vocab)
                    - verifier_bytes(target, weights, 0, max_len, len(taps), dtype, False, world, vocab))
    roles = [_role(name, held, per_slot, verifier_need, slots, max_len, target.max_position_embeddings,
                   int(memory_bytes * verifier_fraction), verifier_fraction)]
    if drafter_shape is not None:
        captured = p.method == "dflash" and device == "cuda"  # on a GPU its proposals are captured: a spare slot

        def drafter_need(s: int, n: int) -> int:
            return drafter_bytes(drafter_weights, *drafter_shape, s, n, dtype, captured)

        per_slot = SlotKVCache.nbytes(drafter_shape[0], 1, drafter_shape[1], max_len, drafter_shape[2], dtype)
        roles.append(_role("drafter", drafter_weights, per_slot, drafter_need, slots, max_len,
                           target.max_position_embeddings,
                           int(memory_bytes * drafter_fraction), drafter_fraction))
    return CapacityPlan(str(m.target_model_path), target.family, p.method, m.dtype, device, memory_bytes, memory,
                        m.gpu_memory_utilization, replicas, graphs, roles)

