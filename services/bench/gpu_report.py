"""`blockspec gpu-check`'s report: a size's row (SizeReport), the table of the sizes, what failed or was left out
under it, the files it writes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blockspec.services.bench.gpu_logits import LogitsCheck, logits_cell

if TYPE_CHECKING:
    from blockspec.services.bench.gpu_smoke import SmokeReport


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
    logits: LogitsCheck | None = None  # the runner's logits against the eager runner's in fp32, on its first layers

    @property
    def floor_ratio(self) -> float:
        return self.decode_ms / self.floor_ms


def table(reports: Sequence[SizeReport]) -> str:
    """One row per size: its logits against fp32, the step's costs against its floor, the drafter and the loop,
    throughput at the fixed acceptance beside plain decoding and transformers, and the exactness counts of the default
    mode."""
    cols = ["size", "params (B)", "runner", "logits / fp32 (error / tolerance, argmax)", "decode ms", "verify-8 ms",
            "verify-16 ms", "floor ms", "decode / floor", "kernels / decode", "c_d k=7", "c_d k=15", "loop overhead ms",
            "tau", "plain tok/s c=1", "spec tok/s c=1", "speedup c=1", "plain tok/s c=8", "spec tok/s c=8",
            "speedup c=8", "transformers tok/s c=1",
            "= plain alone: spec c=1", "plain c=8", "spec c=8", "invariant / fast decode c=1", "c=16"]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]

    def num(x, fmt=".2f") -> str:
        return "-" if x is None else format(x, fmt)

    for r in reports:
        t, n, e = r.tokens_per_s, r.numerics_ms, r.exact
        total = 8 * r.exact_of
        cells = [r.size, r.params_b, r.backend, logits_cell(r.logits), num(r.decode_ms), num(r.verify8_ms),
                 num(r.verify16_ms), num(r.floor_ms), num(r.floor_ratio), num(r.kernels_per_decode, "d"),
                 num(r.c_d.get(7)),
                 num(r.c_d.get(15)), num(r.overhead_ms), num(r.tau), num(t["plain-1"], ".1f"), num(t["spec-1"], ".1f"),
                 num(t["spec-1"] / t["plain-1"]), num(t["plain-8"], ".1f"), num(t["spec-8"], ".1f"),
                 num(t["spec-8"] / t["plain-8"]), num(t.get("peer-1"), ".1f"),
                 f"{e['spec-1']}/{total}", f"{e['plain-8']}/{total}", f"{e['spec-8']}/{total}",
                 num(n["invariant-1"] / n["fast-1"]) if n else "-", num(n["invariant-16"] / n["fast-16"]) if n else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def notes(failures: list[str], reports: Sequence[SizeReport] = (), smoke: SmokeReport | None = None) -> str:
    """What did not run or did not pass, under the table: the smoke's failed cases, the sizes whose logits were off the
    fp32 reference, the stages a size's budget left out, the sizes that failed."""
    lines = []
    if smoke is not None and not smoke.passed:
        lines.append(f"Smoke failed: {', '.join(c.name for c in smoke.cases if not c.passed) or 'the cuBLAS probe'}")
    lines += [f"Logits off the fp32 reference: {r.size} (error {r.logits.error:.1e} over tolerance "
              f"{r.logits.tolerance:.0e})" for r in reports if r.logits is not None and not r.logits.passed]
    lines += [f"Left out of {r.size} (its budget spent): {', '.join(r.skipped)}" for r in reports if r.skipped]
    lines += [f"Failed: {f}" for f in failures]
    return "".join(f"\n{line}\n" for line in lines)


def write(out: Path | None, text: str, reports: Sequence[SizeReport], smoke: SmokeReport | None = None) -> None:
    """gpu_check.md (the text), gpu_check.json (the sizes' reports) and smoke.json under out, where out is given."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
        if smoke is not None:
            (out / "smoke.json").write_text(json.dumps({**asdict(smoke), "passed": smoke.passed}, indent=1))
