"""The dflash proposal as a captured block (dflash/captured.py) where the CPU can check it: the same step runs
uncaptured over its static buffers (and as a replayed graph would, `Graphs.emulate`), drafts what the torch path
drafts, stores the committed tokens' context itself, and keeps streams equal to the target alone."""

from __future__ import annotations

import pytest

from blockspec.common.contracts import Draft, ProposeInput, VerifyInput
from blockspec.services.drafter.proposers import dflash
from blockspec.services.engine.engine import Engine
from blockspec.services.router.step_loop import FinishEvent


def engine(tiny_models, drafter, static: bool, monkeypatch) -> Engine:
    monkeypatch.setattr(dflash, "static_blocks", lambda device: static)
    return Engine(tiny_models["qwen3"]["target"], drafter, "dflash", max_batch=8)


@pytest.mark.parametrize("name", ["qwen3-trained", "qwen3-random"])
def test_static_blocks_draft_what_the_torch_path_drafts(name, tiny_models, dflash_drafters, prompts, monkeypatch):
    """Over the same committed contexts (one request, then five at once, k = 3 and 7, then three verified steps whose
    committed tokens the static step stores itself), the static step's drafts equal the torch module's."""
    drafts = {}
    for static in (False, True):
        e = engine(tiny_models, dflash_drafters[name], static, monkeypatch)
        assert (e.proposer._blocks is not None) == static
        if not static:
            e.proposer._cpu = None  # the torch module, not the C++ block
        ids = [f"r{i}" for i in range(5)]
        for rid, p in zip(ids, prompts):
            e.verifier.add(rid, p)
        e.verifier.prefill(ids)
        got = []
        for k in (3, 7):
            got.append(e.proposer.propose([ProposeInput("r0", e.verifier.committed("r0"), k)]))
            got.append(e.proposer.propose([ProposeInput(r, e.verifier.committed(r), k) for r in ids]))
        for _ in range(3):  # verifies commit tokens: the next proposals store their context first
            got.append(e.proposer.propose([ProposeInput(r, e.verifier.committed(r), 5) for r in ids]))
            e.verifier.verify([VerifyInput(r, Draft(d.token_ids)) for r, d in zip(ids, got[-1])])
        drafts[static] = [[d.token_ids for d in batch] for batch in got]
        assert e.proposer.kernel == ("static blocks" if static else "the torch module")
    assert drafts[True] == drafts[False]
    assert all(len(t) == k for batch, k in zip(drafts[True], (3, 3, 7, 7, 5, 5, 5)) for t in batch)


def test_static_blocks_keep_streams_exact(tiny_models, dflash_drafters, prompts, references, monkeypatch):
    e = engine(tiny_models, dflash_drafters["qwen3-trained"], True, monkeypatch)
    e.proposer._blocks.graphs.emulate = True  # each block computes from the tensors of its first call, as a graph
    eager, proposals = [], []
    extend, propose = e.proposer._extend, e.proposer.propose
    e.proposer._extend = lambda pending, cpu: eager.append(len(pending)) or extend(pending, cpu)
    e.proposer.propose = lambda inputs: proposals.append(len(inputs)) or propose(inputs)
    requests = [e.request(f"r{i}", p, 128, (1, 3, 5, 7)[i % 4]) for i, p in enumerate(prompts)]
    done = {ev.request_id: ev for ev in e.generate(requests) if isinstance(ev, FinishEvent)}
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == references["qwen3"]
    assert sum(ev.stats.accepted for ev in done.values()) > 0
    # the prompts' context stored eagerly, every later step's inside the captured step
    assert 0 < len(eager) < len(proposals) / 4
