"""Runs AC: the cost model's r(k+1) under three timing states, against the step loops' own (BENCHMARKS.md).

python benchmarks/cpu-2core/run-AC/cost_states.py   # from the repository root; about 3 minutes here

Each round: plain decoding and dflash k=5 with prompt lookup over the 16 held-out prompts x 128 tokens (their
verifies timed in the loop: loop r(6) = a verify of 6 over a decode), then r(6) and r(8) on a prefilled request of
128 tokens with every forward timed (interleaved rounds, `services/verifier/verifier.interleaved`)
* after the round's previous forward (the cost model until runs AC: the decode came after a verify of 8),
* after the proposal of its drafts (a decode after a decode),
* after a decode (the cost model since runs AC).
"""

import json
import statistics as st
import time
from pathlib import Path

from blockspec.services.bench import _engine_run
from blockspec.services.drafter.proposer import ProposeInput
from blockspec.services.engine import Engine
from blockspec.services.verifier.verifier import interleaved, rolled_back_verify

HOME = Path("models/base")
KS = (5, 7)


def ratios(verifier, proposer, before: str, repeats: int = 15) -> tuple[float, dict[int, float]]:
    verifier.roll_back(["x"])
    committed = list(verifier.committed("x"))
    verifies = {k: rolled_back_verify(verifier, ["x"], k + 1) for k in (0, *KS)}
    proposals = {k: (lambda k=k: proposer.propose([ProposeInput("x", committed, k)])) for k in KS}
    setups = {"previous": None, "proposal": {0: verifies[0], **proposals},
              "decode": dict.fromkeys(verifies, verifies[0])}[before]
    seconds = interleaved(verifies, repeats, "cpu", setups)
    verifier.roll_back(["x"])
    return seconds[0], {k: seconds[k] / seconds[0] for k in KS}


def main() -> None:
    texts = [json.loads(line) for line in open(HOME / "heldout_prompts.jsonl")]
    engines = {mode: Engine(HOME / "target", HOME / "drafter" if mode != "none" else None,
                            "dflash" if mode != "none" else "none", max_batch=1, max_len=1024,
                            prompt_lookup=mode == "lookup") for mode in ("none", "lookup")}
    costs = Engine(HOME / "target", HOME / "drafter", "dflash", max_batch=1, max_len=160)
    costs.verifier.add("x", list(range(16, 144)))
    costs.verifier.prefill(["x"])
    prompts = [costs.encode(t) for t in texts]
    verifies: dict = {}
    for mode, engine in engines.items():
        inner = engine.verifier.verify

        def timed_verify(inputs, inner=inner, mode=mode):
            started = time.perf_counter()
            out = inner(inputs)
            verifies.setdefault((mode, len(inputs[0].draft_ids)), []).append(time.perf_counter() - started)
            return out

        engine.verifier.verify = timed_verify
        _engine_run(engine, prompts[:2], 16, None if mode == "none" else 5)  # warm-up
    for _ in range(6):
        verifies.clear()
        for mode, engine in engines.items():
            _engine_run(engine, prompts, 128, None if mode == "none" else 5)
        decode, verify6 = st.median(verifies[("none", 0)]), st.median(verifies[("lookup", 5)])
        line = [f"loop: decode {decode * 1e3:.3f} ms, r(6) {verify6 / decode:.3f}"]
        for before in ("previous", "proposal", "decode"):
            d, r = ratios(costs.verifier, costs.proposer, before)
            line.append(f"after {before}: decode {d * 1e3:.3f} ms, r(6) {r[5]:.3f}, r(8) {r[7]:.3f}")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
