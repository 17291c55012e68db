"""The verifier's prefill: how prompts are grouped into target forwards."""

from blockspec.common.models.checkpoint import load_checkpoint
from blockspec.services.verifier.verifier import Verifier

LENGTHS = [60, 50, 90, 20, 120, 30, 250]


def first_tokens(verifier: Verifier, prompts: list[list[int]], budget: int | None = None, forwards=None) -> dict:
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        verifier.add(rid, prompt)
    if forwards is not None:  # record (rows, width) of each target forward
        run = verifier.runner.forward
        def recorded(segs, tap_dest=None):
            forwards.append((len(segs), max(len(s.token_ids) for s in segs)))
            return run(segs, tap_dest)

        verifier.runner.forward = recorded
    out = {}
    while len(out) < len(ids):
        out.update({r.request_id: r.token_ids for r in verifier.prefill([i for i in ids if i not in out], budget)})
    for rid in ids:
        verifier.release(rid)
    return out


def test_cpu_prefill_forwards_hold_at_most_max_rows_padded_rows_and_give_the_same_tokens(tiny_models):
    """Prompts go together while rows x the longest stay within `prefill_rows` (MAX_ROWS: one C++ call each); a
    prompt longer than that goes alone. The first tokens are each prompt's own, prefilled alone; a budget still
    bounds a call's prompt tokens."""
    checkpoint = load_checkpoint(tiny_models["qwen3"]["target"])
    vocab = checkpoint.config.vocab_size
    prompts = [[(7 * i + 3 * j) % (vocab - 4) + 4 for j in range(n)] for i, n in enumerate(LENGTHS)]
    verifier = Verifier(checkpoint, num_slots=len(prompts), max_len=512)
    assert verifier.prefill_rows == 256
    forwards = []
    grouped = first_tokens(verifier, prompts, forwards=forwards)
    assert forwards == [(2, 60), (2, 90), (2, 120), (1, 250)]  # a third prompt would make 3 x 90, 3 x 120, 3 x 250
    alone = {}
    for i, prompt in enumerate(prompts):
        alone.update({f"p{i}": t for t in first_tokens(verifier, [prompt]).values()})
    assert grouped == alone
    budgeted = []
    assert first_tokens(verifier, prompts, budget=100, forwards=budgeted) == alone
    assert all(rows * width <= 256 or rows == 1 for rows, width in budgeted) and max(w for _, w in budgeted) <= 100
