"""The drafter's proposal with its bf16 projections on AMX tiles against vectors, interleaved in one process.

    python benchmarks/cpu-2core/run-AE/amx_ab.py REQUESTS K ITERATIONS   # e.g. 1 7 1000, 14 3 400, 16 7 300

REQUESTS prefilled requests of 128 tokens each; every proposal (k drafts each) is timed right after a verify of
width k + 1, as in the step loop, alternating AMX and vectors call by call; prints the medians and the share of
draft tokens the two agree on. Needs a CPU with AMX (Sapphire Rapids or later) for the comparison to mean anything.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from blockspec.services.drafter.dflash import cpu_block
from blockspec.services.drafter.proposer import ProposeInput
from blockspec.services.engine import Engine
from blockspec.services.verifier.verifier import rolled_back_verify

torch.set_num_threads(2)
R, k, iterations = (int(a) for a in sys.argv[1:4])
engine = Engine(Path("models/base/target"), Path("models/base/drafter"), "dflash", max_batch=R, max_len=300)
ids = [str(i) for i in range(R)]
for i in ids:
    engine.verifier.add(i, list(range(16 + int(i), 16 + int(i) + 128)))
engine.verifier.prefill(ids)
verify = rolled_back_verify(engine.verifier, ids, k + 1)
inputs = [ProposeInput(i, list(engine.verifier.committed(i)), k) for i in ids]
ext = cpu_block._extension.get()
if not ext.set_amx(True):
    sys.exit("no AMX tiles on this CPU (or the kernel did not grant them)")
for _ in range(30):
    verify()
    engine.proposer.propose(inputs)
seconds, drafts = {True: [], False: []}, {}
for it in range(iterations):
    on = bool(it % 2)
    ext.set_amx(on)
    verify()
    t0 = time.perf_counter()
    drafts[on] = [d.token_ids for d in engine.proposer.propose(inputs)]
    seconds[on].append(time.perf_counter() - t0)
same = sum(a == b for x, y in zip(drafts[True], drafts[False]) for a, b in zip(x, y)) / sum(map(len, drafts[True]))
print(f"{R} requests, k={k}: after a verify, AMX {statistics.median(seconds[True]) * 1e3:.3f} ms, vectors "
      f"{statistics.median(seconds[False]) * 1e3:.3f} ms; the same draft tokens: {same:.2f}")
