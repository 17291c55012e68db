"""`blockspec bench`: speculative vs plain decoding vs transformers, side by side in one run, with the
cost model (r(k+1), c_d) and the ceiling tau / r(k+1); markdown, JSON and PNG plots."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from blockspec.common.errors import InvalidArgument
from blockspec.common.sampling import GREEDY, SamplingParams
from blockspec.services.bench.costs import CPU, CostSampler, Device
from blockspec.services.bench.latency import ChunkGaps, latency
from blockspec.services.bench.modes import ENGINE_METHODS, HF_MODES, Mode, Row

log = logging.getLogger(__name__)

COST_REPEATS = 20  # timed rounds of the cost model in each slice (one slice per round of the concurrency-1 passes)


def workload(prompts: Sequence[Sequence[int]], concurrency: int, waves: int) -> list[Sequence[int]]:
    """The requests of one pass at `concurrency`: the prompts in order, cycled to at least `waves` x
    concurrency requests. The loop keeps `concurrency` in flight and admits the next request as one
    finishes, so a pass is mostly steady state; with a single wave (as many prompts as streams) it would be
    mostly the ramp and the tail, where the last few requests run alone."""
    need = max(len(prompts), waves * concurrency)
    return [prompts[i % len(prompts)] for i in range(need)]


def accepted_per_position(counts: Sequence[Sequence[int]], k: int = 0) -> np.ndarray:
    """The requests' accepted drafts per position, summed: as long as the longest list (at least k); a request
    that never drafted (finished at its first token) adds an empty list."""
    total = np.zeros(max([k, *(len(c) for c in counts)]), dtype=int)
    for c in counts:
        total[: len(c)] += np.asarray(c, dtype=int)
    return total


def request_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Request i's sampling in a pass: the bench's settings, seeded seed + i where they sample; the same in every mode
    and pass, so each mode decodes the same requests."""
    return sampling if sampling.greedy else replace(sampling, seed=(sampling.seed + i) % 2**64)


def compared(sampling: SamplingParams, mode: Mode) -> bool:
    """Whether `mode`'s outputs must equal plain decoding's (the `exact` column): greedy, and `strict` sampling in the
    engine's and a server's modes (the text for a seed is the target's own). Under `rejection` the text also depends
    on the drafts; transformers samples with its own noise."""
    return sampling.greedy or (sampling.rule == "strict" and mode.name not in HF_MODES)


def describe_sampling(sampling: SamplingParams, compared_rows: str = "the engine modes") -> str:
    """The sampling settings in a report's first paragraph; compared_rows: the rows `exact` compares under strict."""
    if sampling.greedy:
        return "greedy"
    return (f"sampled at temperature {sampling.temperature:g} (top-k {sampling.top_k or 'off'}, top-p "
            f"{sampling.top_p:g}), rule `{sampling.rule}`, request i seeded {sampling.seed} + i; `exact` compares "
            f"{compared_rows if sampling.rule == 'strict' else 'nothing (under rejection the text follows the drafts)'}")


def _engine_run(engine, prompts: Sequence[Sequence[int]], max_tokens: int, k: int | None,
                arrivals: Sequence[float] | None = None,
                sampling: SamplingParams = GREEDY) -> tuple[float, list, list[float], list[float]]:
    """One pass: (seconds, the finish events in request order, each request's time to first token, the gaps
    between the chunks of every stream). Closed loop (arrivals None): every request queued at once, its TTFT from
    admission. Open loop: request i arrives arrivals[i] seconds into the pass (bench_rate.open_loop), its TTFT from
    arrival."""
    from blockspec.services.router.step_loop import FinishEvent

    requests = [engine.request(str(i), p, max_tokens, k, request_sampling(sampling, i)) for i, p in enumerate(prompts)]
    chunks = ChunkGaps()
    started = time.perf_counter()
    if arrivals is None:
        done, late = [], {}
        for event in engine.generate(requests):
            chunks.saw_events((event,))
            if isinstance(event, FinishEvent):
                done.append(event)
    else:
        from blockspec.services.bench.rate import open_loop

        done, late = open_loop(engine.loop, requests, arrivals, started, chunks)
    elapsed = time.perf_counter() - started
    done = sorted(done, key=lambda e: int(e.request_id))
    if arrivals is None:
        return elapsed, done, [e.stats.first_token_s - e.stats.queued_s for e in done], chunks.gaps
    return elapsed, done, [late[e.request_id] + e.stats.first_token_s for e in done], chunks.gaps


def model_context(target: Path) -> int:
    """The target's context in tokens (max_position_embeddings)."""
    from blockspec.common.models.checkpoint import load_checkpoint

    return load_checkpoint(target, with_weights=False).config.max_position_embeddings


def check_lengths(target: Path, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
    """Every prompt and max_tokens after it within the target's context, or InvalidArgument naming the flag."""
    context, longest = model_context(target), max(len(p) for p in prompts)
    if longest >= context:
        raise InvalidArgument("--prompts-file", f"a prompt of {longest} tokens leaves no room in the model's context of "
                                                f"{context} tokens")
    if longest + max_tokens > context:
        raise InvalidArgument("--max-tokens", f"{max_tokens} after the longest prompt ({longest} tokens) passes the "
                                              f"model's context of {context} tokens: at most {context - longest}")


def engine_runner(target: Path, drafter: Path | None, mode: Mode, prompts, max_tokens: int,
                  concurrency: int, device: Device = CPU, arrivals: Sequence[float] | None = None,
                  sampling: SamplingParams = GREEDY) -> Callable[[], tuple[Row, list]]:
    """A warmed-up engine for `mode` (`drafter`: the DFlash drafter, or for draft_model the assistant); each call of
    the result is one timed pass over the prompts, at most `concurrency` in flight (arrivals: open loop)."""
    from blockspec.services.drafter.proposers.replay import ReplayProposer
    from blockspec.services.engine.engine import Engine

    room = max(len(p) for p in prompts) + max_tokens + 16  # run_bench checked that prompt + max_tokens fit the context
    engine = Engine(target, drafter if mode.name in ("dflash", "draft_model") else None, mode.name,
                    max_batch=concurrency, max_len=min(room, model_context(target)), adaptive_k=mode.adaptive,
                    prompt_lookup=mode.lookup, prompt_lookup_tokens=mode.lookup_tokens, device=device[0], dtype=device[1],
                    threads=torch.get_num_threads(), draft_tree=mode.tree)  # a fixed thread count: modes measured alike
    try:
        _engine_run(engine, prompts[:1], 8, mode.k or None, sampling=sampling)  # warm-up
    except InvalidArgument as e:
        if e.field != "k":
            raise
        raise InvalidArgument("--modes", f"{mode.label}: {e.message}") from None
    replay = None
    if mode.replay:  # one untimed run of the whole workload records the drafts every timed pass gives back
        replay = engine.loop.drafter = ReplayProposer(engine.loop.drafter)
        _engine_run(engine, prompts, max_tokens, mode.k or None, sampling=sampling)
        replay.recording = False

    def run() -> tuple[Row, list]:
        elapsed, done, ttft, gaps = _engine_run(engine, prompts, max_tokens, mode.k or None, arrivals, sampling)
        if replay is not None and replay.misses:
            log.warning("%s: %d proposals were not in the record and drafted nothing", mode.label, replay.misses)
            replay.misses = 0
        steps, drafted, accepted = (sum(getattr(e.stats, a) for e in done) for a in ("steps", "drafted", "accepted"))
        per_pos = accepted_per_position([e.stats.accepted_per_pos for e in done], mode.k)  # lookupN: > k
        tokens = sum(len(e.token_ids) for e in done)
        # One request at a time: its steps are the loop's, so the timers split the wall clock per step.
        alone = concurrency == 1 and steps and arrivals is None  # back to back: no idle time between requests
        split = [elapsed / steps * 1e3, *(sum(getattr(e.stats, a) for e in done) / steps * 1e3
                                          for a in ("verify_s", "draft_s"))] if alone else []
        looked_up = sum(e.stats.looked_up for e in done) / steps if mode.lookup and steps else None
        row = Row(mode.name + mode.flag, mode.k, concurrency, tokens, elapsed,
                  tokens / elapsed,
                  tau=1 + accepted / steps if steps and mode.k else None,
                  acceptance_rate=accepted / drafted if drafted else None, accepted_per_pos=per_pos.tolist(), steps=steps,
                  step_ms=split, looked_up=looked_up,
                  **latency(ttft, [(e.stats.elapsed_s - e.stats.first_token_s, len(e.token_ids) - 1) for e in done],
                            gaps))
        return row, [list(e.token_ids) for e in done]

    return run


def hf_runner(target: Path, mode: Mode, prompts, max_tokens: int, assistant: Path | None,
              device: Device = CPU, sampling: SamplingParams = GREEDY) -> Callable[[], tuple[Row, list]]:
    """transformers `generate` one prompt at a time (concurrency 1): alone, prompt lookup, assisted; sampling with
    the same temperature, top-k and top-p (torch's generator seeded with the bench's seed at each pass). The
    models load and warm up here; each call of the result is one timed pass over the prompts."""
    from transformers import AutoModelForCausalLM

    dev, dtype = device
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(dev).eval()
    kwargs: dict = {"do_sample": False, "max_new_tokens": max_tokens}
    if not sampling.greedy:
        kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    if mode.name == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = mode.k
    elif mode.name.startswith("hf-assisted"):
        helper = AutoModelForCausalLM.from_pretrained(assistant, dtype=dtype).to(dev).eval()
        kwargs["assistant_model"] = helper
        helper.generation_config.num_assistant_tokens = mode.k
        if mode.name == "hf-assisted":  # fixed k, no early stop on low confidence
            helper.generation_config.num_assistant_tokens_schedule = "constant"
            helper.generation_config.assistant_confidence_threshold = 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=dev), **{**kwargs, "max_new_tokens": 8})  # warm-up

    def run() -> tuple[Row, list]:
        outputs = []
        if not sampling.greedy:
            torch.manual_seed(sampling.seed % 2**63)
        with torch.inference_mode():
            started = time.perf_counter()
            for p in prompts:
                out = model.generate(torch.tensor([p], device=dev), **kwargs)
                outputs.append(out[0, len(p):].tolist())
            elapsed = time.perf_counter() - started
        tokens = sum(len(o) for o in outputs)
        return Row(mode.name, mode.k, 1, tokens, elapsed, tokens / elapsed), outputs

    return run


def machine(device: Device = CPU) -> str:
    # The vector extension decides the CPU kernels' speed (the same VM type came with AVX-512 and with AVX2 only).
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({torch.backends.cpu.get_cpu_capability()}), " \
           f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    dev, dtype = device
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "the CPU"
    return f"{host}; models on {where} in {str(dtype).removeprefix('torch.')}"


def timed_passes(runners: dict, rounds: int, bar=None, after_round: Callable[[], None] | None = None) -> dict:
    """Each runner `rounds` times, the modes interleaved in another order every round (drift hits every mode
    alike), after_round() after each round -> {mode: (its median pass's row, with every pass's tokens/s and
    TPOT, every pass's outputs)}."""
    ms = list(runners)
    samples: dict[Mode, list[Row]] = {m: [] for m in ms}
    outputs_of: dict[Mode, list] = {m: [] for m in ms}
    for r in range(rounds):
        for m in ms[r % len(ms):] + ms[: r % len(ms)]:
            row, outputs = runners[m]()
            outputs_of[m].append(outputs)
            samples[m].append(row)
            if bar is not None:
                bar.update()
        if after_round is not None:
            after_round()
    medians = {}
    for m in ms:
        row = sorted(samples[m], key=lambda row: row.tokens_per_s)[len(samples[m]) // 2]
        row.rounds = [p.tokens_per_s for p in samples[m]]
        row.tpot_rounds = [p.tpot_ms for p in samples[m] if p.tpot_ms is not None]
        medians[m] = (row, outputs_of[m])
    return medians


def against_plain(passes: dict, rate: float | None = None, plain: Mode = Mode("none"),
                  compare: Callable[[Mode], bool] = lambda mode: True) -> list[Row]:
    """timed_passes' median rows, each compared with the `plain` mode's tokens/s; exact when every pass of the mode
    gave plain decoding's first pass's outputs (without a plain mode: no ratio, exact unknown; for a mode `compare`
    refuses, e.g. one sampling under `rejection`: exact unknown)."""
    base, (plain_outputs, *_) = passes.get(plain, (None, (None,)))
    for mode, (row, outputs) in passes.items():
        row.request_rate = rate
        if base is not None:
            row.exact = all(o == plain_outputs for o in outputs) if compare(mode) else None
            row.speedup = row.tokens_per_s / base.tokens_per_s
    return [row for row, _ in passes.values()]


def run_bench(target: Path, drafter: Path | None, prompts: list[list[int]], modes: list[Mode], concurrency: list[int],
              max_tokens: int, out: Path, assistant: Path | None = None, progress: bool = True, rounds: int = 3,
              waves: int = 4, device: Device = CPU, request_rates: Sequence[float] = (), max_concurrency: int = 16,
              sampling: SamplingParams = GREEDY) -> dict:
    """Run every mode at every concurrency (transformers modes at 1), `rounds` passes each (draft_model
    and the hf-assisted modes with `assistant` as their draft model),
    interleaved, each pass over `workload(prompts, concurrency, waves)`; report the median pass; check
    exactness against plain decoding; measure the cost model; write bench.md / bench.json / plots into `out`.
    With request_rates, the engine modes also run open loop (bench_rate): requests arriving at each rate, at most
    max_concurrency in flight, over `workload(prompts, max_concurrency, waves)`. sampling: every request's (request i
    seeded seed + i); the cost model stays greedy's."""
    from blockspec.services.bench.rate import arrival_times, check_rates
    from blockspec.services.bench.report import describe, markdown, plots  # it imports Mode and Row from here

    needs = sorted({m.label for m in modes if m.name == "draft_model" or m.name.startswith("hf-assisted")})
    if needs and assistant is None:
        raise InvalidArgument("--assistant", f"modes {', '.join(needs)} need an assistant (draft model) directory")
    check_lengths(target, prompts, max_tokens)
    check_rates(request_rates, len(workload(prompts, max_concurrency, waves)))
    out.mkdir(parents=True, exist_ok=True)
    if not any(m.name == "none" for m in modes):
        modes = [Mode("none"), *modes]  # the baseline every ratio needs
    plan = [(c, [m for m in modes if m.name in ENGINE_METHODS or c == 1]) for c in concurrency]  # transformers: c=1
    if 1 not in concurrency and any(m.name not in ENGINE_METHODS for m in modes):
        log.warning("the transformers modes run at concurrency 1 only, which --concurrency leaves out: they do not run")
    ks = sorted({m.k for m in modes if m.name == "dflash"})
    sampler = CostSampler(target, drafter, ks, device=device) if drafter and ks else None
    engine_modes = [m for m in modes if m.name in ENGINE_METHODS]

    def runner(m: Mode, work: list, c: int, arrivals: list[float] | None = None):
        if m.name not in ENGINE_METHODS:
            return hf_runner(target, m, work, max_tokens, assistant, device, sampling)
        return engine_runner(target, assistant if m.name == "draft_model" else drafter, m, work, max_tokens, c, device,
                             arrivals, sampling)

    def compare(m: Mode) -> bool:
        return compared(sampling, m)

    rows, rate_rows = [], []
    total = rounds * (sum(len(ms) for _, ms in plan) + len(engine_modes) * len(request_rates))
    with tqdm(total=total, desc="bench", disable=not progress) as bar:
        for c, ms in plan:
            work = workload(prompts, c, waves)
            # The ceiling's costs, timed among the concurrency-1 passes they are compared with.
            sample = (lambda: sampler.sample(COST_REPEATS)) if sampler is not None and c == 1 else None
            rows += against_plain(timed_passes({m: runner(m, work, c) for m in ms}, rounds, bar, sample), compare=compare)
        for rate in request_rates:
            work = workload(prompts, max_concurrency, waves)
            arrivals = arrival_times(len(work), rate)
            if arrivals[-1] > 60:
                log.warning("at %g requests/s the %d requests of a pass arrive over %.0f s; %d modes x %d rounds",
                            rate, len(work), arrivals[-1], len(engine_modes), rounds)
            rate_rows += against_plain(timed_passes({m: runner(m, work, max_concurrency, arrivals) for m in engine_modes},
                                               rounds, bar), rate, compare=compare)
    if sampler is not None and not sampler.slices:  # no concurrency-1 passes: timed once, at the end
        sampler.sample(COST_REPEATS * rounds)
    costs = sampler.model() if sampler is not None else None
    kernel = getattr(sampler.engine.proposer, "kernel", None) if sampler is not None else None
    header = describe(machine(device), f"{target} + {drafter}", len(prompts), max_tokens, waves, rounds,
                      sliced=sampler is not None and 1 in concurrency, rates=request_rates, cap=max_concurrency,
                      drafter_kernel=kernel, sampling=describe_sampling(sampling))
    report = markdown(rows, costs, header, rate_rows)
    (out / "bench.md").write_text(report)
    result = {"machine": machine(device), "target": str(target), "drafter": str(drafter), "drafter_kernel": kernel,
              "prompts": len(prompts), "waves": waves, "sampling": asdict(sampling),
              "max_tokens": max_tokens, "rows": [asdict(r) for r in rows], "rate_rows": [asdict(r) for r in rate_rows],
              "request_rates": list(request_rates), "max_concurrency": max_concurrency, "costs": asdict(costs) if costs else None}
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    result["plots"] = [str(p) for p in plots(rows, out, rate_rows)]
    result["markdown"] = report
    return result
