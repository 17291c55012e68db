"""What the sampling rule costs the host per request and step, by vocabulary size: the processors, the warping, the
accept tests and the recovered or bonus sample (`Verifier._decide`'s work for a sampled request) over synthetic rows
shaped like a language model's (N(0, 2.5) logits, 20 tokens raised by 8-16), T 0.7.

* `plain`: one row, its sample (plain decoding's step);
* `rejection k 3`: four rows, three drafts sampled from a q over the 32 tokens a noisier copy of the row ranks first
  (the drafter's candidates), the rejection rule;
* each again with top-p 0.9 (`, top-p 0.9`), as chat front ends send it.

Mean microseconds over 200 seeded calls per cell, one JSON line per vocabulary size. Any checkout runs it: put the
checkout first on PYTHONPATH (a directory holding a `blockspec` link to it) to time another commit the same way.

    .venv/bin/python benchmarks/cpu-2core-avx2/sampled-bench/rule_cost.py [--vocab 4096,151936,248320]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from blockspec.common.runtime.distributions import DraftDist, LogProbRows, gumbel_at, process
from blockspec.common.sampling import SamplingParams
from blockspec.services.verifier.acceptance import rejection_accept

K, CANDIDATES, CALLS, T = 3, 32, 200, 0.7


def rows(vocab: int, n: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, vocab, generator=generator) * 2.5
    top = torch.randint(0, vocab, (n, 20), generator=generator)
    return x.scatter_add(1, top, 8 + 8 * torch.rand(n, 20, generator=generator))


def drafts(logits: torch.Tensor, seed: int, generator: torch.Generator) -> tuple[list[int], DraftDist]:
    """K drafts, each sampled from q: softmax over the candidates of a noisier copy of its row."""
    noisy = logits[:K] + torch.randn(K, logits.shape[1], generator=generator)
    scores, ids = noisy.topk(CANDIDATES, dim=-1)
    q = (scores.double() / T).softmax(-1)
    picks = [int((q[i].log() + gumbel_at(seed, 100 + i, 1, ids[i])).argmax()) for i in range(K)]
    return [int(ids[i, j]) for i, j in enumerate(picks)], DraftDist(ids, q.float())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="4096,151936,248320")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for vocab in (int(v) for v in args.vocab.split(",")):
        g = torch.Generator().manual_seed(vocab)
        cases = []
        for seed in range(CALLS):
            logits = rows(vocab, K + 1, g)
            cases.append((seed, logits, *drafts(logits, seed, g)))
        out = {"vocab": vocab}
        for seed, logits, draft_ids, q in cases[:5]:  # untimed: the kernels' first load, the first touches
            sp = SamplingParams(temperature=T, seed=seed)
            rejection_accept(draft_ids, LogProbRows(process(logits, [1], 0, draft_ids, sp), sp), q, seed, 100)
        for (name, width), top_p in itertools.product((("plain", 1), ("rejection k 3", K + 1)), (1.0, 0.9)):
            name += ", top-p 0.9" if top_p < 1 else ""
            accepted = 0
            started = time.perf_counter()
            for seed, logits, draft_ids, q in cases:
                sp = SamplingParams(temperature=T, top_p=top_p, seed=seed)
                d = draft_ids if width > 1 else []
                processed = process(logits[:width], [1, 2, 3], 2, d, sp)
                accepted += rejection_accept(d, LogProbRows(processed, sp), q if d else None, seed, 100).num_accepted
            out[f"{name} us"] = round((time.perf_counter() - started) / CALLS * 1e6, 1)
            if width > 1:
                out[f"{name}: acceptance"] = round(accepted / (K * CALLS), 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
