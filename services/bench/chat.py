"""A multi-turn chat benchmark: conversations over one shared system prompt, each turn resending the whole
conversation (the last prompt, its reply and a new user message), served with prefix caching on and off side by side.
Per turn: time to first token (p50, p99) each way and their ratio, whether every turn's tokens are the same both ways,
and the prefix cache's hit rate.

    python -m blockspec.services.bench.chat                       # the shipped pair, concurrency 1 and 8
    python -m blockspec.services.bench.chat --concurrency 8 --turns 6 --out bench-out/chat.md
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from blockspec.common.prompts import read_prompts_file
from blockspec.services.router.step_loop import FinishEvent

PAIR = Path(__file__).resolve().parents[2] / "models" / "base"


@dataclass
class Conversation:
    """One conversation: the prompt of its next turn, the user messages still to come, each turn's reply and TTFT."""

    prompt: list[int]
    messages: list[list[int]]
    replies: list[list[int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)


def held_out_texts() -> list[str]:
    """The held-out files of the shipped pair's corpus (the standard library's: never trained on)."""
    from blockspec.services.training.corpus import all_files, default_sources, iter_texts, split_files

    return list(iter_texts(split_files(all_files(default_sources()[:1]))[1]))


def conversations(tokenizer, texts: Sequence[str], count: int, turns: int, system_tokens: int,
                  message_tokens: int) -> list[Conversation]:
    """`count` conversations of `turns` turns: a system prompt of `system_tokens` tokens cut from the joined texts
    (the same for all), and user messages of `message_tokens` cut from the rest, spread over it."""
    ids = tokenizer.encode("\n".join(texts))
    system, rest = ids[:system_tokens], ids[system_tokens:]
    if len(system) < system_tokens or len(rest) < message_tokens:
        raise ValueError(f"the texts hold {len(ids)} tokens: too few for a system prompt of {system_tokens}")
    starts = np.linspace(0, len(rest) - message_tokens, count * turns).astype(int)
    pieces = [rest[s : s + message_tokens] for s in starts]
    return [Conversation(system + pieces[c * turns], [pieces[c * turns + t] for t in range(1, turns)])
            for c in range(count)]


def serve(engine, convs: list[Conversation], concurrency: int, max_tokens: int, k: int | None) -> float:
    """Run every conversation to its end, `concurrency` at a time, each turn submitted once the last one has
    finished; returns the seconds it took. Each turn's TTFT is from its admission (no wait for a slot)."""
    loop, pending, live = engine.loop, list(range(len(convs))), {}
    started = time.perf_counter()

    def submit(c: int) -> None:
        turn = len(convs[c].replies)
        live[f"c{c}t{turn}"] = c
        convs[c].prompt_lens.append(len(convs[c].prompt))
        loop.submit(engine.request(f"c{c}t{turn}", convs[c].prompt, max_tokens, k))

    while pending and len(live) < concurrency:
        submit(pending.pop(0))
    while live:
        for event in loop.step():
            if not isinstance(event, FinishEvent):
                continue
            conv = convs[live.pop(event.request_id)]
            conv.replies.append(list(event.token_ids))
            conv.ttft_s.append(event.stats.first_token_s - event.stats.queued_s)
            if conv.messages:
                conv.prompt = conv.prompt + conv.replies[-1] + conv.messages.pop(0)
                submit(convs.index(conv))
            elif pending:
                submit(pending.pop(0))
    return time.perf_counter() - started


def run(pair: Path, concurrency: int, count: int, turns: int, system_tokens: int, message_tokens: int,
        max_tokens: int, method: str, k: int | None) -> dict:
    from blockspec.services.engine.engine import Engine

    texts = held_out_texts()
    out = {}
    for caching in (False, True):
        engine = Engine(pair / "target", pair / "drafter" if method == "dflash" else None, method,
                        max_batch=max(concurrency, 1), prefix_caching=caching)
        convs = conversations(engine.tokenizer, texts, count, turns, system_tokens, message_tokens)
        warm = conversations(engine.tokenizer, read_prompts_file(pair / "heldout_prompts.jsonl", "--pair"), 1, 1, 64,
                             message_tokens)  # kernels built, weights packed
        serve(engine, warm, 1, 8, k)
        engine.verifier.prefix_stats.queries = engine.verifier.prefix_stats.hits = 0
        elapsed = serve(engine, convs, concurrency, max_tokens, k)
        stats = engine.verifier.prefix_stats
        out[caching] = {"convs": convs, "elapsed_s": elapsed,
                        "hit_rate": stats.hits / stats.queries if stats.queries else 0.0,
                        "preemptions": engine.loop.preemptions}
    return out


def report(results: dict, concurrency: int) -> tuple[str, dict]:
    off, on = results[False], results[True]
    turns = len(off["convs"][0].replies)
    lines = [f"### concurrency {concurrency}: {len(off['convs'])} conversations of {turns} turns",
             "", "| turn | prompt tokens (mean) | TTFT p50 off (ms) | TTFT p50 on (ms) | p50 off / on | TTFT p99 off (ms) "
             "| TTFT p99 on (ms) | tokens identical |", "|---|---|---|---|---|---|---|---|"]
    table = []
    for t in range(turns):
        a = np.array([c.ttft_s[t] for c in off["convs"]]) * 1e3
        b = np.array([c.ttft_s[t] for c in on["convs"]]) * 1e3
        same = all(x.replies[t] == y.replies[t] for x, y in zip(off["convs"], on["convs"]))
        length = np.mean([c.prompt_lens[t] for c in off["convs"]])
        row = {"turn": t + 1, "p50_off_ms": float(np.median(a)), "p50_on_ms": float(np.median(b)),
               "p99_off_ms": float(np.percentile(a, 99)), "p99_on_ms": float(np.percentile(b, 99)), "identical": same}
        table.append(row)
        lines.append(f"| {t + 1} | {length:.0f} | {row['p50_off_ms']:.1f} | {row['p50_on_ms']:.1f} | "
                     f"{row['p50_off_ms'] / row['p50_on_ms']:.1f}x | {row['p99_off_ms']:.1f} | {row['p99_on_ms']:.1f} | "
                     f"{'yes' if same else 'NO'} |")
    lines += ["", f"Prefix cache hit rate (prompt tokens found cached): {on['hit_rate']:.1%}; whole run "
              f"{off['elapsed_s']:.1f} s off, {on['elapsed_s']:.1f} s on; preemptions {off['preemptions']} off, "
              f"{on['preemptions']} on."]
    return "\n".join(lines), {"concurrency": concurrency, "turns": table, "hit_rate": on["hit_rate"],
                              "elapsed_s": [off["elapsed_s"], on["elapsed_s"]]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", type=Path, default=PAIR, help=(
        "a pair directory (target/, drafter/, heldout_prompts.jsonl) trained on the standard library's corpus"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--message-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens a turn's reply")
    parser.add_argument("--method", default="dflash", choices=("dflash", "none"))
    parser.add_argument("--k", type=int, default=None, help="draft tokens a step (unset: the method's default)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (and its .json beside it)")
    args = parser.parse_args(argv)
    texts, rows = [], []
    for c in args.concurrency:
        text, row = report(run(args.pair, c, args.conversations, args.turns, args.system_tokens, args.message_tokens,
                               args.max_tokens, args.method, args.k), c)
        print(text + "\n", flush=True)
        texts.append(text)
        rows.append(row)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n\n".join(texts) + "\n")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["identical"] for row in rows for r in row["turns"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
