"""`blockspec gpu-check`'s smoke stage, before the first size: the versions, the copy bandwidth, whether torch's
products (cuBLAS) are row-invariant beside the Triton GEMM's time, and each batch-invariant operator
(smoke_cases.CASES) at the reference shapes: its time and bandwidth at 1 and 16 rows, whether a row alone equals the
same row in a batch, and its bf16 error against the fp32 reference. On the CPU the same at the tiny sizes' shapes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from blockspec.common.kernels.gemm_choice import GemmChoice
from blockspec.services.bench.smoke_cases import CASES, MAX_ROWS, Case, SmokeShapes

log = logging.getLogger(__name__)

# Seconds the stage may take (a minute of the check's 8): past them, its cases still to come are left out, named.
SMOKE_LIMIT_S = 60.0
TIMED_ROWS = (1, 16)  # a decode; a verify block or 16 requests
INVARIANT_ROWS = (1, 16, MAX_ROWS)  # a row alone, in a batch of 16, in the largest batch
CALLS_PER_GRAPH = 10  # calls of an operator captured in the CUDA graph its time is taken from
SHAPES = {"cuda": ("27b", "27b-hybrid"), "cpu": ("tiny", "tiny-hybrid")}  # the sizes whose shapes the cases take


@dataclass
class CaseReport:
    name: str
    shape: str
    ms: dict[int, float]  # median ms of a call at 1 and 16 rows (op_ms)
    gb_s: dict[int, float]  # bytes read and written per call over its time
    invariant: bool | None  # a row alone equals the same row at 16 and MAX_ROWS rows, bit for bit
    error: float | None  # max abs error of the bf16 output over the max abs of the fp32 reference's, at 16 rows
    tolerance: float
    required_invariant: bool  # on CUDA (the Triton operators); the CPU's torch references promise no row invariance
    passed: bool  # error within the tolerance, invariant where required, no exception
    captured: bool | None = None  # on CUDA: timed in CUDA graphs (False: the calls did not capture, timed as calls)
    failure: str | None = None  # the exception, where the case raised


@dataclass
class GemmReport:
    choice: GemmChoice | None  # common/kernels/gemm_choice.choose_gemm over the reference targets' weight shapes
    weight: tuple[int, int]  # the weight timed, (N, K)
    cublas_ms: dict[int, float] = field(default_factory=dict)  # F.linear, cuBLAS configured, at 1 and 16 rows
    triton_ms: dict[int, float] = field(default_factory=dict)  # gpu_kernels.linear
    failure: str | None = None


@dataclass
class SmokeReport:
    versions: dict[str, str]
    bandwidth_gb_s: float
    gemm: GemmReport | None
    cases: list[CaseReport]
    left_out: tuple[str, ...]  # what the stage's time limit left out
    seconds: float
    limit_s: float | None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases) and (self.gemm is None or self.gemm.failure is None)


def smoke_shapes(device: str) -> SmokeShapes:
    """The reference shapes on CUDA (27b, 27b-hybrid, Qwen3.6-35B-A3B's experts), the tiny ones elsewhere."""
    from blockspec.common.models.model_config import parse_config
    from blockspec.services.bench.gpu_sizes import hf_config
    from blockspec.services.training.tiny import PUBLISHED, tiny_family_config, tiny_tokenizer

    gpu = device.startswith("cuda")
    dense, hybrid = SHAPES["cuda" if gpu else "cpu"]
    moe = PUBLISHED["qwen3_5_moe"] if gpu else tiny_family_config("qwen3_5_moe", tiny_tokenizer())
    return SmokeShapes(*(parse_config(hf_config(size), Path(f"<{size}>")) for size in (dense, hybrid)),
                       parse_config({**moe, "eos_token_id": moe["vocab_size"] - 1}, Path("<moe>")),
                       context=1024 if gpu else 64)


def runner_weights(cfg) -> list[tuple[int, int]]:
    """The (N, K) of every product a CUDA runner's step runs for the model: q/k/v and gate/up merged, the LM head."""
    H, KV, D, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    shapes = [(2 * cfg.intermediate_size, hidden), (hidden, cfg.intermediate_size), (cfg.vocab_size, hidden)]
    if cfg.hybrid:  # gated attention (q and its gate, k, v), and a Gated DeltaNet layer's two products
        lin = cfg.linear
        shapes += [((2 * H + 2 * KV) * D, hidden), (hidden, H * D),
                   (lin.conv_dim + lin.value_dim + 2 * lin.num_v_heads, hidden), (hidden, lin.value_dim)]
    else:
        shapes += [((H + 2 * KV) * D, hidden), (hidden, H * D)]
    return shapes


def versions(device: str) -> dict[str, str]:
    import platform

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "-"
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        out.update(device=props.name, sms=str(props.multi_processor_count))
    else:
        out.update(device="cpu", sms="-")
    return out


def _outputs(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, tuple) else [x]


def _fp32(args: tuple) -> tuple:
    """The arguments in fp32: tensors copied, a dtype argument (the model's) fp32."""
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                 torch.float32 if isinstance(a, torch.dtype) else a for a in args)


def error(out, ref) -> float:
    """Max abs error of each output over the max abs of its reference's, the largest over the outputs."""
    worst = 0.0
    for o, r in zip(_outputs(out), _outputs(ref)):
        if not r.numel():
            continue
        scale = float(r.abs().max())
        worst = max(worst, float((o.float() - r).abs().max()) / (scale or 1.0))
    return worst


def invariant(case: Case) -> bool:
    """Each row of the op over the first m rows equals the same row over more (INVARIANT_ROWS), bit for bit."""
    outs = {m: _outputs(case.op(*case.args(m))) for m in INVARIANT_ROWS}
    return all(torch.equal(a, b[:m]) for m, n in zip(INVARIANT_ROWS, INVARIANT_ROWS[1:])
               for a, b in zip(outs[m], outs[n]))


def moved_bytes(case: Case, m: int) -> int:
    if case.bytes is not None:
        return case.bytes(m)
    tensors = [a for a in case.args(m) if isinstance(a, torch.Tensor)] + _outputs(case.op(*case.args(m)))
    return sum(t.numel() * t.element_size() for t in tensors)


def op_ms(fn: Callable[[], object], repeats: int, device: str) -> tuple[float, bool]:
    """(median ms of one call, whether it was captured): on CUDA from a CUDA graph of CALLS_PER_GRAPH calls, replayed
    (the kernels' time without the host's launches, as the runner's captured steps run them); where the calls do not
    capture, and off CUDA, from the calls themselves."""
    from blockspec.common.runtime.timing import timed

    if device.startswith("cuda"):
        fn()  # compiled and loaded outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(CALLS_PER_GRAPH):
                    fn()
        except RuntimeError as e:
            log.warning("timed as calls: they did not capture (%s)", e)
        else:
            return timed(graph.replay, repeats, device) / CALLS_PER_GRAPH * 1e3, True
    return timed(fn, repeats, device) * 1e3, False


def run_case(name: str, make: Callable[..., Case], shapes: SmokeShapes, device: str, repeats: int,
             require_invariance: bool) -> CaseReport:
    """One case's row; an exception becomes its failure."""
    tolerance, cuda = float("nan"), device.startswith("cuda")
    try:
        case = make(shapes, torch.bfloat16, device)
        tolerance = case.tolerance
        ms, gb_s, captured = {}, {}, True if cuda else None
        with torch.inference_mode():
            for m in TIMED_ROWS:
                args = case.args(m)
                ms[m], graphed = op_ms(lambda: case.op(*args), repeats, device)
                gb_s[m] = moved_bytes(case, m) / ms[m] / 1e6
                captured = (captured and graphed) if cuda else None
            same = invariant(case)
            args = case.args(16)
            err = error(case.op(*args), case.reference(*_fp32(args)))
        return CaseReport(name, case.shape, ms, gb_s, same, err, tolerance, require_invariance,
                          err <= tolerance and (same or not require_invariance), captured)
    except Exception as e:  # noqa: BLE001 - a failing operator is a row of the table, not the end of the check
        log.exception("smoke case %s failed", name)
        return CaseReport(name, "-", {}, {}, None, None, tolerance, require_invariance, False,
                          failure=f"{type(e).__name__}: {e}")


def gemm_line(device: str, shapes: SmokeShapes, timeout_s: float | None) -> GemmReport:
    """The cuBLAS probe and the two GEMMs' times, in a child process: configuring cuBLAS binds a process from its first
    product on, and this one's products (the sizes' `fast` numerics) stay torch's defaults. timeout_s: None waits."""
    import multiprocessing as mp

    weights = list(dict.fromkeys(runner_weights(shapes.dense) + runner_weights(shapes.hybrid)))
    timed_weight = (2 * shapes.dense.intermediate_size, shapes.dense.hidden_size)  # the dense target's gate/up
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_gemm_child, args=(send, device, weights, timed_weight), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(None if timeout_s is None else max(timeout_s, 1.0)):
            return GemmReport(None, timed_weight, failure=f"not done in {timeout_s:.0f} s, the smoke's time left")
        return receive.recv()
    except EOFError:
        child.join()
        return GemmReport(None, timed_weight, failure=f"its process ended with exit code {child.exitcode}")
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.terminate()
            child.join()


def _gemm_child(send, device: str, weights: list[tuple[int, int]], timed_weight: tuple[int, int]) -> None:
    try:
        send.send(gemm_report(device, weights, timed_weight))
    except Exception as e:  # noqa: BLE001 - whatever the probe or the kernels raise is the line's failure
        send.send(GemmReport(None, timed_weight, failure=f"{type(e).__name__}: {e}"))


def gemm_report(device: str, weights: list[tuple[int, int]], timed_weight: tuple[int, int]) -> GemmReport:
    """choose_gemm over the weights (configuring cuBLAS first on CUDA: call it before the process's first product),
    then F.linear against gpu_kernels.linear over timed_weight at TIMED_ROWS rows."""
    from blockspec.common.kernels import gpu_kernels as gk
    from blockspec.common.kernels.gemm_choice import choose_gemm

    choice = choose_gemm(weights, device)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(timed_weight, generator=gen, device=device).mul_(0.02).bfloat16()
    x = torch.randn((max(TIMED_ROWS), timed_weight[1]), generator=gen, device=device).bfloat16()
    repeats = 20 if device.startswith("cuda") else 3
    with torch.inference_mode():
        cublas = {m: op_ms(lambda: F.linear(x[:m], w), repeats, device)[0] for m in TIMED_ROWS}
        triton = {m: op_ms(lambda: gk.linear(x[:m], w), repeats, device)[0] for m in TIMED_ROWS}
    return GemmReport(choice, timed_weight, cublas, triton)


def run_smoke(device: str, bandwidth: float, limit_s: float | None = SMOKE_LIMIT_S,
              cases: dict[str, Callable[..., Case]] | None = None,
              require_invariance: bool | None = None) -> SmokeReport:
    """The stage (see the module docstring). bandwidth: bytes/s of the check's copy (gpu_check.copy_bandwidth). Past
    limit_s seconds (None: no limit) the cases still to come are left out and named. cases: CASES unless given.
    require_invariance (default: on CUDA, where the operators are the Triton kernels): a case whose rows depend on
    their batch fails."""
    started = time.perf_counter()
    deadline = None if limit_s is None else started + limit_s
    cuda = device.startswith("cuda")
    shapes = smoke_shapes(device)
    left_out: list[str] = []

    def left() -> float | None:
        return None if deadline is None else deadline - time.perf_counter()

    def spent() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    gemm = None if spent() else gemm_line(device, shapes, left())
    if gemm is None:
        left_out.append("cuBLAS probe")
    reports = []
    for name, make in (cases or CASES).items():
        if spent():
            left_out.append(name)
            continue
        reports.append(run_case(name, make, shapes, device, 20 if cuda else 3,
                                cuda if require_invariance is None else require_invariance))
        if cuda:
            torch.cuda.empty_cache()
    return SmokeReport(versions(device), bandwidth / 1e9, gemm, reports, tuple(left_out),
                       time.perf_counter() - started, limit_s)


def smoke_table(report: SmokeReport) -> str:
    """The versions and the copy bandwidth, the cuBLAS line, then a row per operator case; what was left out."""
    v = report.versions
    lines = [f"Smoke ({report.seconds:.0f} s): python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, Triton "
             f"{v['triton']}, {v['device']}, {v['sms']} SMs; copy bandwidth {report.bandwidth_gb_s:.0f} GB/s.",
             "", _gemm_text(report.gemm), ""]
    cols = ["operator", "shape", "ms 1 row", "GB/s 1 row", "ms 16 rows", "GB/s 16 rows",
            f"row alone = in a batch ({'/'.join(map(str, INVARIANT_ROWS))})", "bf16 error / fp32 max", "tolerance",
            "pass"]
    lines += ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]

    def num(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for c in report.cases:
        mark = "*" if c.captured is False else ""
        same = "-" if c.invariant is None else ("yes" if c.invariant else "NO" if c.required_invariant else "no")
        cells = [c.name, c.shape, num(c.ms.get(1), ".4f") + mark, num(c.gb_s.get(1), ".0f"),
                 num(c.ms.get(16), ".4f") + mark, num(c.gb_s.get(16), ".0f"), same, num(c.error, ".1e"),
                 format(c.tolerance, ".0e"),
                 "ok" if c.passed else f"FAILED{': ' + c.failure if c.failure else ''}"]
        lines.append("| " + " | ".join(cells) + " |")
    if any(c.captured is False for c in report.cases):
        lines.append("\n* timed as calls, host launches included: the calls did not capture in a CUDA graph")
    if report.left_out:
        lines.append(f"\nLeft out of the smoke (its {report.limit_s:.0f} s spent): {', '.join(report.left_out)}")
    return "\n".join(lines) + "\n"


def _gemm_text(g: GemmReport | None) -> str:
    if g is None:
        return "cuBLAS probe: left out."
    if g.failure is not None:
        return f"cuBLAS probe: FAILED: {g.failure}"
    c = g.choice
    found = "row-invariant" if c.mismatch is None else f"not row-invariant ({c.mismatch})"
    times = ", ".join(f"{m} row{'s' * (m > 1)}: cuBLAS {g.cublas_ms[m]:.4f} ms, Triton {g.triton_ms[m]:.4f} ms"
                      for m in TIMED_ROWS)
    configured = "; ".join(c.settings) or "not configured"
    return (f"cuBLAS probe ({configured}): {found} over {len(c.shapes)} weight shapes at "
            f"{', '.join(map(str, c.rows))} rows -> {c.chosen} ({c.seconds:.1f} s). A {g.weight[0]} x {g.weight[1]} "
            f"weight: {times}.")
