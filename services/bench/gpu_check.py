"""`blockspec gpu-check`: first a smoke stage (gpu_smoke.py: versions, the operators at the reference shapes, the
cuBLAS probe), then random-weight Qwen3-shaped targets up to the reference size (~27B, bf16), Qwen3.5 hybrids
(`tiny-hybrid`, and `27b-hybrid` with Qwen3.5-27B's published shape) and a matching DFlash drafter on one GPU. Per
size one row: its runner's logits against the eager runner's in fp32 (gpu_logits.py), then decode, verify-8 and
verify-16 ms against the memory-bandwidth floor (bytes a decode reads over a large device-to-device copy's bandwidth,
measured in the same run), kernels per decode, the drafter's cost c_d, the step loop's overhead, plain and
speculative tokens/s at concurrency 1 and 8 with a drafter of fixed acceptance (tau 3.6, so the speedup does not hang
on random weights) beside transformers' static-cache `generate` (compiled on the GPU; `--peer`), the default mode's
exactness against plain decoding alone (at concurrency 1 and in batches of 8), and what the batch-invariant numerics
cost against torch's products, each size within its budget. Then CUDA IPC sharing between two processes.

`--device cpu --sizes tiny,tiny-hybrid` runs the same code on the CPU in seconds (what the tests run)."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import torch

from blockspec.common.models.checkpoint import Checkpoint
from blockspec.common.models.model_config import parse_config
from blockspec.common.runtime.cuda_runner import unsupported
from blockspec.services.bench.gpu_logits import check_logits
from blockspec.services.bench.gpu_report import SizeReport, notes, table, write
from blockspec.services.bench.gpu_sizes import check_fits, hf_config, random_drafter, random_target

log = logging.getLogger(__name__)

KS = (1, 3, 5, 7, 15)


THROUGHPUT_TOKENS = 64  # per request of the throughput and exactness runs, after a 128-token prompt
SPEC_K = 7  # draft tokens per step of those runs: a verify of 8
# Seconds a size may take before its optional stages (step-loop overhead, the numerics' cost, transformers) are left
# out: the smoke stage (gpu_smoke.SMOKE_LIMIT_S), four sizes and the sharing check fit 8 minutes, cold Triton and
# compile caches counted. The logits against fp32, the step costs, the kernels, the throughput and the exactness
# counts always run.
SIZE_BUDGET_S = 90.0


def check_size(size: str, device: str, dtype: torch.dtype, context: int = 1024, repeats: int = 20,
               bandwidth: float | None = None, backend: str = "auto", peer: bool = False,
               budget_s: float | None = SIZE_BUDGET_S) -> SizeReport:
    """One size's row, its logits against fp32 first. Past `budget_s` seconds from its start (None: no budget) the
    optional stages still to come are left out and named in `skipped`."""
    from blockspec.services.bench.costs import cost_ratios

    deadline = None if budget_s is None else time.perf_counter() + budget_s
    skipped: list[str] = []

    def room(stage: str) -> bool:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(stage)
            return False
        return True

    if backend == "graphs" and unsupported(parse_config(hf_config(size), Path(size))):  # a shape its kernels refuse
        backend = "auto"
    logits = check_logits(size, device, dtype, backend)
    if device.startswith("cuda"):  # its truncated targets and graphs given back before the whole target is made
        gc.collect()
        torch.cuda.empty_cache()
    target = random_target(size, device, dtype)
    context = min(context, 256) if size.startswith("tiny") else context
    params = sum(w.numel() for w in target.weights.values()) / 1e9
    prompt = torch.randint(0, target.config.vocab_size - 1, (context,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    drafter = random_drafter(size, target.config, device, dtype)
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
                      kernels, r, c_d, overhead, tau, tps, exact, THROUGHPUT_TOKENS, numerics, tuple(skipped), logits)


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


def tensor_parallel_line(device: str) -> str:
    """The check's line on tensor parallelism: run on CUDA; on the CPU its tests run it (a process group lasts the
    process, and the CPU check runs many times in one)."""
    if not device.startswith("cuda"):
        return "on GPUs only here (on the CPU: tests/common/runtime/test_tensor_parallel.py, over gloo)"
    return check_tensor_parallel(device)


def check_tensor_parallel(device: str) -> str:
    """Two ranks (two GPUs, or two CPU processes over gloo) of a small Qwen3-shaped target, the device's runner on
    each: plain and speculative decoding with the fixed-acceptance drafter against plain decoding at the same
    tensor_parallel_size, one request and 8 together (`throughput`). Said skipped, with why, on a machine of one GPU.
    Last of the check: its process group stays for the rest of the process."""
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        return f"skipped: it needs two GPUs, this machine has {torch.cuda.device_count()}"
    import tempfile

    from blockspec.common.models.checkpoint import load_checkpoint
    from blockspec.services.training.tiny import build_tiny_checkpoint, tiny_tokenizer
    from blockspec.services.verifier.verifier import Verifier

    with tempfile.TemporaryDirectory() as root:
        path = build_tiny_checkpoint(Path(root) / "target", "qwen3", hidden_size=256, num_layers=4,
                                     tokenizer=tiny_tokenizer())
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        verifier = Verifier(load_checkpoint(path), num_slots=8, max_len=512, dtype=dtype, device=device,
                            tensor_parallel_size=2)
        prompt = torch.randint(0, verifier.runner.config.vocab_size - 1, (256,),
                               generator=torch.Generator().manual_seed(1)).tolist()
        tau, tps, exact = throughput(verifier, prompt, device)
    total = 8 * THROUGHPUT_TOKENS
    return (f"2 ranks ({type(verifier.runner).__name__}), tau {tau:.2f}: equal to plain decoding alone at 2 ranks on "
            f"spec c=1 {exact['spec-1']}/{total}, plain c=8 {exact['plain-8']}/{total}, spec c=8 "
            f"{exact['spec-8']}/{total} tokens; speedup c=1 {tps['spec-1'] / tps['plain-1']:.2f}")


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


def main(sizes: list[str], device: str, out: Path | None, backend: str = "auto", peer: bool = False,
         budget_s: float | None = SIZE_BUDGET_S, smoke: bool = True) -> int:
    """The smoke stage (unless `smoke` is False; its own time limit), then each size in turn, each within its budget
    (check_size); a size that fails is said (its error under the table, the traceback in the log) and the next one
    runs: one run on a lent GPU keeps whatever it could measure. Exit code 1 when a size failed, its logits were off the
    fp32 reference, or a smoke case failed."""
    import traceback

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    check_fits(sizes, device, dtype)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    reports, failures = [], []
    bandwidth = copy_bandwidth(device)
    head = f"Device: {name}, dtype {dtype}, copy bandwidth {bandwidth / 1e9:.0f} GB/s.\n\n"
    report = None
    if smoke:
        from blockspec.services.bench.gpu_smoke import run_smoke, smoke_table

        try:
            report = run_smoke(device, bandwidth)
            head += smoke_table(report) + "\n"
        except Exception as e:  # noqa: BLE001 - a smoke that breaks is said, and the sizes still run
            traceback.print_exc()
            failures.append(f"smoke stage: {type(e).__name__}: {e}")
        print(head, flush=True)
        write(out, head + notes(failures), reports, report)
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
        write(out, f"{head}{table(reports)}\n{notes(failures, reports, report)}", reports, report)
    text = (f"{head}{table(reports)}\n{notes(failures, reports, report)}\n"
            f"Sharing between processes: {check_ipc(device)}\n"
            f"Tensor parallelism: {tensor_parallel_line(device)}\n")
    print(text)
    write(out, text, reports, report)
    wrong = (any(r.logits is not None and not r.logits.passed for r in reports)
             or (report is not None and not report.passed))
    return 1 if failures or wrong else 0
