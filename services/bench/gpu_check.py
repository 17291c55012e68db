"""`blockspec gpu-check`: random-weight Qwen3-shaped targets up to the reference size (~27B, bf16), Qwen3.5 hybrids
(`tiny-hybrid`, and `27b-hybrid` with Qwen3.5-27B's published shape) and a matching DFlash drafter on one GPU. Per
size one row: decode, verify-8 and verify-16 ms against the memory-bandwidth floor (bytes a decode reads over a large
device-to-device copy's bandwidth, measured in the same run), kernels per decode, the drafter's cost c_d, the step
loop's overhead, plain and speculative tokens/s at concurrency 1 and 8 with a drafter of fixed acceptance (tau 3.6,
so the speedup does not hang on random weights) beside transformers' static-cache `generate` (compiled on the GPU;
`--peer`), the default mode's exactness against plain decoding alone (at concurrency 1 and in batches of 8), and what
the batch-invariant numerics cost against torch's products, each size within its budget. Then CUDA IPC sharing
between two processes.

`--device cpu --sizes tiny,tiny-hybrid` runs the same code on the CPU in seconds (what the tests run)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.runtime.cuda_runner import unsupported
from blockspec.services.bench.gpu_sizes import check_fits, hf_config, random_drafter, random_target

log = logging.getLogger(__name__)

KS = (1, 3, 5, 7, 15)


@dataclass
class SizeReport:
    size: str
    params_b: float
    backend: str  # the verifier's runner: "graphs" (cuda_runner, captured) or "eager"
    decode_ms: float
    verify8_ms: float
    verify16_ms: float
    floor_ms: float  # bytes a decode reads (weights, KV / states at the context) over the measured copy bandwidth
    kernels_per_decode: int | None  # GPU kernels of one decode step (None off the GPU)
    r: dict[int, float]  # r(k + 1)
    c_d: dict[int, float]  # drafter proposal / one target decode
    overhead_ms: float | None  # step loop time per step beyond the drafter and verifier calls
    tau: float  # tokens per step of the fixed-acceptance runs (measured)
    tokens_per_s: dict[str, float]  # "plain-1", "spec-1", "plain-8", "spec-8", "peer-1" (transformers)
    exact: dict[str, int]  # tokens equal to plain decoding alone before the first difference: "spec-1", "plain-8", ...
    exact_of: int  # tokens per request compared
    numerics_ms: dict[str, float]  # decode ms of the CUDA runner: "invariant-1", "fast-1", "invariant-16", "fast-16"
    skipped: tuple[str, ...] = ()  # optional stages left out: the size's budget was spent before them

    @property
    def floor_ratio(self) -> float:
        return self.decode_ms / self.floor_ms


THROUGHPUT_TOKENS = 64  # per request of the throughput and exactness runs, after a 128-token prompt
SPEC_K = 7  # draft tokens per step of those runs: a verify of 8
# Seconds a size may take before its optional stages (step-loop overhead, the numerics' cost, transformers) are left
# out: four sizes and the sharing check fit 8 minutes, cold Triton and compile caches counted. The step costs, the
# kernels, the throughput and the exactness counts always run.
SIZE_BUDGET_S = 105.0


def check_size(size: str, device: str, dtype: torch.dtype, context: int = 1024, repeats: int = 20,
               bandwidth: float | None = None, backend: str = "auto", peer: bool = False,
               budget_s: float | None = SIZE_BUDGET_S) -> SizeReport:
    """One size's row. Past `budget_s` seconds from its start (None: no budget) the optional stages still to come are
    left out and named in `skipped`."""
    from blockspec.services.bench.costs import cost_ratios

    deadline = None if budget_s is None else time.perf_counter() + budget_s
    skipped: list[str] = []

    def room(stage: str) -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(stage)
            return False
        return True

    target = random_target(size, device, dtype)
    context = min(context, 256) if size.startswith("tiny") else context
    params = sum(w.numel() for w in target.weights.values()) / 1e9
    prompt = torch.randint(0, target.config.vocab_size - 1, (context,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    drafter = random_drafter(size, target.config, device, dtype)
    if backend == "graphs" and unsupported(target.config):  # a shape the CUDA runner's kernels do not take
        backend = "auto"
    verifier, proposer = roles(target, drafter, None, context + 64, dtype, device, slots=8, backend=backend)
    backend = "graphs" if type(verifier.runner).__name__ == "CudaRunner" else "eager"
    verifier.add("x", prompt)
    verifier.prefill(["x"])
    decode, r, c_d = cost_ratios(verifier, proposer, "x", KS, repeats, device)
    kernels = kernels_per_decode(verifier, "x", device)
    verifier.release("x")
    proposer.release("x")
    tau, tps, exact = throughput(verifier, prompt, device)
    overhead = loop_overhead(verifier, proposer, prompt, repeats, device) if room("loop overhead") else None
    del proposer, drafter, verifier
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    numerics = numerics_cost(target, prompt[:256], dtype, device) if backend == "graphs" and room("numerics") else {}
    tps["peer-1"] = peer_tokens_per_s(size, target, prompt[:128], device, dtype) if peer and room("transformers") \
        else None
    floor = decode_bytes(target.config, context, dtype) / (bandwidth or copy_bandwidth(device)) * 1e3
    del target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return SizeReport(size, round(params, 3), backend, decode * 1e3, decode * r[7] * 1e3, decode * r[15] * 1e3, floor,
                      kernels, r, c_d, overhead, tau, tps, exact, THROUGHPUT_TOKENS, numerics, tuple(skipped))


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read plus written), the best of five."""
    from blockspec.common.runtime.timing import timed

    size = (1 << 30) if device.startswith("cuda") else (1 << 27)
    src = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), 1, device, warm_up=i == 0) for i in range(5))
    return 2 * size / best


def decode_bytes(cfg, context: int, dtype: torch.dtype) -> int:
    """What one decode step reads: every weight but the embedding table (one row of it), and the slot's KV cache or
    states at the context."""
    from blockspec.common.runtime.footprint import parameters, slot_bytes

    weights = parameters(cfg).active - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    per_slot = slot_bytes(cfg, context, dtype)
    return weights * dtype.itemsize + per_slot["kv"] + per_slot["conv"] + per_slot["recurrent"]


def kernels_per_decode(verifier, request_id: str, device: str) -> int | None:
    """GPU kernels launched by one decode step, counted by the profiler (a captured step run uncaptured: the graph
    holds the same kernels). None off the GPU."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    from blockspec.services.verifier.verifier import rolled_back_verify

    graphs, decode = getattr(verifier.runner, "graphs", None), rolled_back_verify(verifier, [request_id], 1)
    captures = graphs.capture if graphs is not None else None
    if graphs is not None:
        graphs.capture = False
    try:
        decode()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode()
            torch.cuda.synchronize()
    finally:
        if graphs is not None:
            graphs.capture = captures
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset")))


def throughput(verifier, prompt: list[int], device: str) -> tuple[float, dict[str, float], dict[str, int]]:
    """Plain and speculative decoding through the step loop, at concurrency 1 (each request alone) and 8 (together),
    with the fixed-acceptance drafter (tau 3.6, k = SPEC_K) over each request's plain-alone tokens: (measured tau,
    tokens/s, tokens of each run equal to plain decoding alone before they part, summed over requests; 8 requests of
    THROUGHPUT_TOKENS)."""
    from blockspec.services.drafter.proposers.replay import FixedAcceptanceProposer
    from blockspec.services.router.step_loop import FinishEvent, Request, StepLoop

    vocab = verifier.runner.config.vocab_size
    prompts = {f"p{i}": tuple(prompt[i * 7 : i * 7 + 128]) for i in range(8)}

    def run(requests: list[Request], drafter) -> tuple[dict[str, list[int]], float, int]:
        loop = StepLoop(verifier, drafter, max_batch=8)
        started = time.perf_counter()
        done = [e for e in loop.run(requests) if isinstance(e, FinishEvent)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return ({e.request_id: list(e.token_ids) for e in done}, seconds, sum(e.stats.steps for e in done))

    nothing = FixedAcceptanceProposer({}, SPEC_K, vocab)
    alone, seconds = {}, 0.0
    for rid, p in prompts.items():  # plain decoding alone: the reference, and plain-1's time
        tokens, s, _ = run([Request(rid, p, THROUGHPUT_TOKENS, 0)], nothing)
        alone.update(tokens)
        seconds += s
    tps = {"plain-1": 8 * THROUGHPUT_TOKENS / seconds}
    streams = {rid: [*prompts[rid], *tokens] for rid, tokens in alone.items()}
    exact, total_tokens, total_steps = {}, 0, 0

    def same(got: dict[str, list[int]]) -> int:
        return sum(next((i for i, (a, b) in enumerate(zip(got[r], alone[r])) if a != b), len(alone[r])) for r in alone)

    got, seconds = {}, 0.0
    for rid, p in prompts.items():
        tokens, s, steps = run([Request(rid, p, THROUGHPUT_TOKENS, SPEC_K)],
                               FixedAcceptanceProposer(streams, SPEC_K, vocab))
        got.update(tokens)
        seconds, total_tokens, total_steps = seconds + s, total_tokens + THROUGHPUT_TOKENS, total_steps + steps
    tps["spec-1"], exact["spec-1"] = 8 * THROUGHPUT_TOKENS / seconds, same(got)
    for name, k in (("plain-8", 0), ("spec-8", SPEC_K)):
        got, seconds, steps = run([Request(rid, p, THROUGHPUT_TOKENS, k) for rid, p in prompts.items()],
                                  FixedAcceptanceProposer(streams, SPEC_K, vocab))
        tps[name], exact[name] = 8 * THROUGHPUT_TOKENS / seconds, same(got)
    return total_tokens / max(total_steps, 1), tps, exact


def numerics_cost(target: Checkpoint, prompt: list[int], dtype: torch.dtype, device: str) -> dict[str, float]:
    """Decode ms of the CUDA runner with batch-invariant numerics (the default) and with torch's products ("fast"),
    one request and 16 at once."""
    from blockspec.common.runtime.cuda_runner import CudaRunner
    from blockspec.common.runtime.runner import Segment
    from blockspec.common.runtime.timing import interleaved

    out = {}
    runners = {n: CudaRunner(target, 16, len(prompt) + 8, (), dtype, device, numerics=n, warm_up=False)
               for n in ("invariant", "fast")}
    for runner in runners.values():
        slots = [runner.cache.allocate() for _ in range(16)]
        runner.forward([Segment(s, prompt, last_only=True) for s in slots])

    def decode(runner, batch: int):
        def run() -> None:
            for s in range(batch):
                runner.cache.set_length(s, len(prompt))
            runner.forward([Segment(s, [5]) for s in range(batch)])
        return run

    seconds = interleaved({(n, b): decode(r, b) for n, r in runners.items() for b in (1, 16)}, 10, device)
    for (n, b), sec in seconds.items():
        out[f"{n}-{b}"] = sec * 1e3
    return out


def peer_tokens_per_s(size: str, target: Checkpoint, prompt: list[int], device: str,
                      dtype: torch.dtype) -> float | None:
    """transformers `generate` of the same weights (shared, not copied) with its static cache, compiled on the GPU:
    tokens/s of THROUGHPUT_TOKENS greedy tokens after a warm-up run. None for a family transformers lacks here."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    try:
        config = AutoConfig.for_model(**hf_config(size))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, KeyError):
        return None
    state = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in target.weights.items()}
    state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    expected = model.state_dict()
    model.load_state_dict({k: state[k] for k in expected if k in state}, strict=False, assign=True)
    if any(p.is_meta for p in model.parameters()):
        return None
    for parent in [m for m in model.modules() if hasattr(m, "rotary_emb")]:  # its tables: made again on the device
        with torch.device(device):
            parent.rotary_emb = type(parent.rotary_emb)(config=getattr(config, "text_config", config))
    if any(b.is_meta for b in model.buffers()):
        return None
    model.eval()
    if device.startswith("cuda"):
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.tensor([prompt], device=device)
    settings = {"max_new_tokens": THROUGHPUT_TOKENS, "min_new_tokens": THROUGHPUT_TOKENS, "do_sample": False,
                "cache_implementation": "static"}
    try:  # the peer is a column of the table: a failure of transformers' path is reported, not the end of the run
        with torch.inference_mode():
            model.generate(ids, **settings)  # compiles
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            model.generate(ids, **settings)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - whatever transformers or the compiler raise
        log.warning("%s: transformers' generate failed (%s: %s); its column is left empty", size, type(e).__name__, e)
        return None
    return THROUGHPUT_TOKENS / (time.perf_counter() - started)


def roles(target: Checkpoint, drafter, query_width: int | None, max_len: int, dtype: torch.dtype, device: str,
          slots: int = 2, backend: str = "auto"):
    """The verifier (the device's default runner) and the dflash proposer over it."""
    from blockspec.services.drafter.proposers.dflash import DFlashProposer
    from blockspec.services.verifier.verifier import Verifier

    verifier = Verifier(target, num_slots=slots, max_len=max_len, query_width=query_width,
                        tap_layers=drafter.cfg.tap_points, dtype=dtype, device=device, backend=backend)
    proposer = DFlashProposer(drafter, verifier.runner.embedding, verifier.runner.lm_head, verifier.features, slots,
                              verifier.max_len, tap_buffer=verifier.tap_buffer)
    return verifier, proposer


def loop_overhead(verifier, proposer, prompt: list[int], repeats: int, device: str) -> float:
    """Milliseconds per step-loop step (k=5) beyond the drafter and verifier calls it makes."""
    from blockspec.services.router.step_loop import Request, StepLoop

    loop = StepLoop(verifier, proposer, max_batch=2)
    loop.submit(Request("y", tuple(prompt), 64, 5))
    loop.step()
    steps, inner, started = 0, 0.0, time.perf_counter()
    while not loop.idle and steps < repeats:
        loop.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        inner += loop.last_report.draft_s + loop.last_report.verify_s if loop.last_report else 0.0
        steps += 1
    overhead = ((time.perf_counter() - started) - inner) / max(steps, 1) * 1e3
    list(loop.run([]))  # finish the request: its slot is free again
    return overhead


def check_ipc(device: str) -> str:
    """Export a tensor from this process and map it in a child: same bytes, no copy (CUDA IPC / shm)."""
    import multiprocessing as mp

    from blockspec.common.wire.tensor_share import SharedTensors

    shares = SharedTensors()
    try:
        tensor = torch.arange(1 << 20, dtype=torch.float32, device=device)
        shared, handle = shares.export(tensor)
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            total = pool.apply(_child_sum, (handle,))
        expected = float(shared.sum())
        return f"{handle.kind}: child read sum {total:.0f}, expected {expected:.0f} -> {'ok' if total == expected else 'MISMATCH'}"
    finally:
        shares.close()


def _child_sum(handle) -> float:
    from blockspec.common.wire.tensor_share import open_handle

    return float(open_handle(handle).sum())


def table(reports: list[SizeReport]) -> str:
    """One row per size: the step's costs against its floor, the drafter and the loop, throughput at the fixed
    acceptance beside plain decoding and transformers, and the exactness counts of the default mode."""
    cols = ["size", "params (B)", "runner", "decode ms", "verify-8 ms", "verify-16 ms", "floor ms", "decode / floor",
            "kernels / decode", "c_d k=7", "c_d k=15", "loop overhead ms", "tau", "plain tok/s c=1", "spec tok/s c=1",
            "speedup c=1", "plain tok/s c=8", "spec tok/s c=8", "speedup c=8", "transformers tok/s c=1",
            "= plain alone: spec c=1", "plain c=8", "spec c=8", "invariant / fast decode c=1", "c=16"]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]

    def num(x, fmt=".2f") -> str:
        return "-" if x is None else format(x, fmt)

    for r in reports:
        t, n, e = r.tokens_per_s, r.numerics_ms, r.exact
        total = 8 * r.exact_of
        cells = [r.size, r.params_b, r.backend, num(r.decode_ms), num(r.verify8_ms), num(r.verify16_ms),
                 num(r.floor_ms), num(r.floor_ratio), num(r.kernels_per_decode, "d"), num(r.c_d.get(7)),
                 num(r.c_d.get(15)), num(r.overhead_ms), num(r.tau), num(t["plain-1"], ".1f"), num(t["spec-1"], ".1f"),
                 num(t["spec-1"] / t["plain-1"]), num(t["plain-8"], ".1f"), num(t["spec-8"], ".1f"),
                 num(t["spec-8"] / t["plain-8"]), num(t.get("peer-1"), ".1f"),
                 f"{e['spec-1']}/{total}", f"{e['plain-8']}/{total}", f"{e['spec-8']}/{total}",
                 num(n["invariant-1"] / n["fast-1"]) if n else "-", num(n["invariant-16"] / n["fast-16"]) if n else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(sizes: list[str], device: str, out: Path | None, backend: str = "auto", peer: bool = False,
         budget_s: float | None = SIZE_BUDGET_S) -> int:
    """Each size in turn, each within its budget (check_size); one that fails is said (its error under the table, the
    traceback in the log) and the next one runs: one run on a lent GPU keeps whatever it could measure. Exit code 1
    when a size failed."""
    import traceback

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    check_fits(sizes, device, dtype)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    reports, failures = [], []
    bandwidth = copy_bandwidth(device)
    head = f"Device: {name}, dtype {dtype}, copy bandwidth {bandwidth / 1e9:.0f} GB/s."
    for size in sizes:  # the files are rewritten after each size: a run cut short keeps what it measured
        started, outcome = time.perf_counter(), "done"
        try:
            reports.append(check_size(size, device, dtype, bandwidth=bandwidth, backend=backend, peer=peer,
                                      budget_s=budget_s))
        except Exception as e:  # noqa: BLE001 - a failing size must not cost the others
            traceback.print_exc()
            failures.append(f"{size}: {type(e).__name__}: {e}")
            outcome = "failed"
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"{size}: {outcome} in {time.perf_counter() - started:.0f} s", flush=True)
        _write(out, f"{head}\n\n{table(reports)}\n{_failed(failures, reports)}", reports)
    text = (f"{head}\n\n{table(reports)}\n{_failed(failures, reports)}\n"
            f"Sharing between processes: {check_ipc(device)}\n")
    print(text)
    _write(out, text, reports)
    return 1 if failures else 0


def _failed(failures: list[str], reports: list[SizeReport] = ()) -> str:
    """What did not run, under the table: the sizes that failed, the stages a size's budget left out."""
    skipped = "".join(f"\nLeft out of {r.size} (its budget spent): {', '.join(r.skipped)}\n"
                      for r in reports if r.skipped)
    return skipped + "".join(f"\nFailed: {f}\n" for f in failures)


def _write(out: Path | None, text: str, reports: list[SizeReport]) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
