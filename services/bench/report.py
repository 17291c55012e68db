"""`blockspec bench`'s report: the markdown tables (every row; the ceiling tau / r(k+1) against the measured
speedups; the step loop's split) and the PNG plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from blockspec.services.bench.costs import CostModel
from blockspec.services.bench.modes import Mode, Row


def describe(machine: str, pair: str, prompts: int, max_tokens: int, waves: int, rounds: int, sliced: bool,
             rates: Sequence[float] = (), cap: int = 0, drafter_kernel: str | None = None,
             sampling: str = "greedy") -> str:
    """The report's first paragraph: the machine, the pair (and where the dflash drafter's proposals run), the
    workload (sampling: how its requests decode, in words) and how each figure was taken."""
    pair += f" (the dflash drafter: {drafter_kernel})" if drafter_kernel else ""
    text = (f"Machine: {machine}. Pair: {pair}. {prompts} prompts x {max_tokens} new tokens, {sampling}; a pass at "
            f"concurrency c serves max({prompts}, {waves} c) requests (the prompts cycled), c at a time. Each row is "
            f"the pass with the median tokens/s of {rounds} interleaved passes (its latencies are that pass's).")
    if sliced:
        text += " The cost model is timed in slices, one after each round of the concurrency-1 passes."
    if rates:
        text += (f" Open loop: requests arriving at {', '.join(f'{r:g}' for r in rates)} per second (Poisson, the same "
                 f"arrival times for every mode), at most {cap} in flight, max({prompts}, {waves} x {cap}) requests a "
                 "pass; TTFT from arrival.")
    return text


def markdown(rows: list[Row], costs: CostModel | None, header: str, rate_rows: Sequence[Row] = ()) -> str:
    lines = [header, "", "| mode | concurrency | tokens/s | passes (min-max) | vs plain | TTFT ms (p50 / p99) | TPOT ms (all / p99) "
             "| ITL ms (p50 / p99) | tau | acceptance "
             "| accepted per position | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        spread = _spread(r.rounds, ".0f")
        lines.append(f"| {Mode(r.mode, r.k).label} | {r.concurrency} | {r.tokens_per_s:.1f} | {spread} | {_ratio(r.speedup)} | "
                     f"{_latencies(r)} | {_fmt(r.tau, '.2f')} | "
                     f"{_fmt(r.acceptance_rate, '.3f')} | {', '.join(map(str, r.accepted_per_pos)) or '-'} | "
                     f"{_exact(r.exact)} |")
    looked = [f"{Mode(r.mode, r.k).label} {r.looked_up:.0%} at concurrency {r.concurrency}" for r in rows if r.looked_up is not None]
    if looked:
        lines += ["", "Request-steps drafted by prompt lookup (the drafter drafted the rest): " + "; ".join(looked) + "."]
    if costs is not None:
        lines += _ceiling_table(rows, costs)
    if any(r.step_ms for r in rows):
        lines += _step_table([r for r in rows if r.step_ms])
    if rate_rows:
        lines += _rate_table(rate_rows)
    return "\n".join(lines) + "\n"


def _rate_table(rows: Sequence[Row]) -> list[str]:
    """The open-loop passes: at a request rate the throughput follows the load while the engine keeps up, so the
    latencies are the figures to compare (TTFT from arrival)."""
    lines = ["", "Open loop (requests arriving at a rate; at most `cap` in flight; TTFT from arrival, the wait for a "
             "slot included):", "",
             "| mode | requests/s | cap | tokens/s | passes (min-max) | vs plain | TTFT ms (p50 / p99) | TPOT ms (all / p99) "
             "| ITL ms (p50 / p99) | tau | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {Mode(r.mode, r.k).label} | {r.request_rate:g} | {r.concurrency} | {r.tokens_per_s:.1f} | "
                     f"{_spread(r.rounds, '.0f')} | {_ratio(r.speedup)} | {_latencies(r)} | {_fmt(r.tau, '.2f')} | "
                     f"{_exact(r.exact)} |")
    return lines


def _latencies(r: Row) -> str:
    """The TTFT, TPOT and ITL cells of a row."""
    return (f"{_pair(r.ttft_ms, r.ttft_p99_ms, '.2f')} | {_pair(r.tpot_ms, r.tpot_p99_ms, '.3f')} | "
            f"{_pair(r.itl_ms, r.itl_p99_ms, '.3f')}")


def _exact(exact: bool | None) -> str:
    """The `exact` cell: "-" where no plain decoding ran to compare with."""
    return "-" if exact is None else "yes" if exact else "NO"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(x: float | None) -> str:
    """A row's tokens/s over plain decoding's ("-" without a plain baseline, e.g. a server's rows)."""
    return "-" if x is None else f"{x:.2f}x"


def _pair(x: float | None, y: float | None, spec: str) -> str:
    """A latency cell: the typical figure and its 99th percentile ("-" where the row has none)."""
    return "-" if x is None else f"{x:{spec}} / {_fmt(y, spec)}"


def _ceiling_table(rows: list[Row], costs: CostModel) -> list[str]:
    """The cost model, and each concurrency-1 dflash row's speedup against its ceiling tau / r(k+1): end to end
    (tokens/s, the prefill included) and in the decode phase (TPOT, as the ceiling counts: steps only)."""
    spread = "; ".join(f"r({k + 1}) {_spread(v)}" for k, v in costs.r_slices.items() if v)
    slices = len(next(iter(costs.r_slices.values()), [None]))
    lines = ["", f"Cost model at context {costs.context}: one target decode step {costs.decode_ms:.2f} ms; the median of "
             f"{slices} slice{'s' if slices > 1 else ''} ({spread}). The decode phase is each request's time after its "
             "first token (TPOT): the ceiling counts steps, not the prefill.", "",
             "| mode | r(k+1) | c_d | tau (c=1) | ceiling tau / r(k+1) | with drafter tau / (r(k+1) + c_d) | measured speedup "
             "| of ceiling | of ceiling per round (min-max) | decode-phase speedup | of ceiling, decode phase (per round) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = next((r for r in rows if r.mode == "none" and r.concurrency == 1), None)  # there whenever a c=1 row is
    for r in rows:
        # Adaptive k and longer lookups (`lookupN`) verify other widths than k + 1: no ceiling at r(k + 1); nor
        # has a row that drafted nothing (max_tokens 1 or 2: no room for a draft), whose steps were decodes.
        longer = any(part.startswith("lookup") and part != "lookup" for part in r.mode.split())
        if r.concurrency != 1 or r.mode.split()[0] != "dflash" or "adaptive" in r.mode or longer or r.tau is None \
                or r.acceptance_rate is None or r.k not in costs.r:
            continue
        ceiling = r.tau / costs.r[r.k]
        # Replayed drafts cost nothing; with prompt lookup the drafter runs only on the steps lookup did not draft.
        c_d = 0.0 if r.mode.endswith("replay") else costs.c_d.get(r.k, 0.0) * (1 - (r.looked_up or 0.0))
        # Each round's pass against the same round's plain pass and that round's own cost slice (one slice
        # follows each round at concurrency 1): how far the machine's drift moves the share.
        slices = costs.r_slices[r.k]
        per_round = [a / b / (r.tau / rr) for a, b, rr in zip(r.rounds, plain.rounds, slices)]
        decode = [b / a / (r.tau / rr) for a, b, rr in zip(r.tpot_rounds, plain.tpot_rounds, slices)]
        speedup = plain.tpot_ms / r.tpot_ms if r.tpot_ms and plain.tpot_ms else None
        lines.append(f"| {Mode(r.mode, r.k).label} | {costs.r[r.k]:.2f} | {c_d:.2f} | {r.tau:.2f} | {ceiling:.2f} | "
                     f"{r.tau / (costs.r[r.k] + c_d):.2f} | {r.speedup:.2f} | {r.speedup / ceiling:.2f} | {_spread(per_round)} | "
                     f"{_fmt(speedup, '.2f')} | {_fmt(speedup and speedup / ceiling, '.2f')} ({_spread(decode)}) |")
    if len(lines) == 5:  # no row to compare: say so instead of an empty table
        lines[3:] = ["No dflash row at concurrency 1 drafted at a fixed k: no ceiling to compare with."]
    return lines


def _spread(values: Sequence[float], spec: str = ".2f") -> str:
    return f"{min(values):{spec}}-{max(values):{spec}}" if values else "-"


def _step_table(split: list[Row]) -> list[str]:
    lines = ["", "Inside the step loop at concurrency 1 (ms per step; the rest is prefill, the drafter-free part of a",
             "step's bookkeeping and the loop itself). `verify / step` is the part of a step spent in the target's",
             "forward; divided by plain decoding's, it is the share of the ceiling the loop reaches if its verify costs",
             "r(k+1) decodes, as the ceiling assumes: each fraction comes from one pass, so the machine's drift",
             "between passes, which moves the measured share above, mostly cancels. A diagnostic, not the goal's figure:", "",
             "| mode | step | verify | drafter | rest | verify / step | against plain decoding's |",
             "|---|---|---|---|---|---|---|"]
    plain_split = next((r.step_ms for r in split if r.mode == "none"), None)
    for r in split:
        step, verify, draft = r.step_ms
        ratio = "-" if plain_split is None or r.mode == "none" else f"{verify / step / (plain_split[1] / plain_split[0]):.2f}"
        lines.append(f"| {Mode(r.mode, r.k).label} | {step:.2f} | {verify:.2f} | {draft:.2f} | {step - verify - draft:.2f} | "
                     f"{verify / step:.2f} | {ratio} |")
    return lines


def plots(rows: list[Row], out: Path, rate_rows: Sequence[Row] = ()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(Mode(r.mode, r.k).label for r in rows):
        pts = sorted((r.concurrency, r.tokens_per_s) for r in rows if Mode(r.mode, r.k).label == label)
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(xscale="log", xlabel="concurrency", ylabel="tokens/s", title="Throughput by mode")
    ax.set_xticks(sorted({r.concurrency for r in rows}), labels=[str(c) for c in sorted({r.concurrency for r in rows})])
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "tokens_per_s.png")
    fig.savefig(paths[-1], dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if r.concurrency == 1 and r.accepted_per_pos and r.steps:
            ax.plot(range(1, len(r.accepted_per_pos) + 1), np.array(r.accepted_per_pos) / r.steps, marker="o",
                    label=Mode(r.mode, r.k).label)
    ax.set(xlabel="draft position", ylabel="accepted / steps", title="Acceptance per position (concurrency 1)")
    if ax.lines:  # none without a concurrency-1 speculative row
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "acceptance_per_position.png")
    fig.savefig(paths[-1], dpi=110)
    if rate_rows:
        paths.append(_rate_plot(plt, rate_rows, out / "latency_by_rate.png"))
    plt.close("all")
    return paths


def _rate_plot(plt, rows: Sequence[Row], path: Path) -> Path:
    """The open-loop passes: TPOT (all requests) and TTFT (99th percentile) against the request rate, per mode."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for label in dict.fromkeys(Mode(r.mode, r.k).label for r in rows):
        mine = sorted((r for r in rows if Mode(r.mode, r.k).label == label), key=lambda r: r.request_rate)
        rates = [r.request_rate for r in mine]
        axes[0].plot(rates, [r.tpot_ms for r in mine], marker="o", label=label)
        axes[1].plot(rates, [r.ttft_p99_ms for r in mine], marker="o", label=label)
    axes[0].set(xlabel="requests / s", ylabel="TPOT ms (all requests)", title="Time per output token, open loop")
    axes[1].set(xlabel="requests / s", ylabel="TTFT ms (99th percentile)", title="Time to first token, open loop")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
