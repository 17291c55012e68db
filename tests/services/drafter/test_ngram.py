from blockspec.common.contracts import ProposeInput
from blockspec.common.tokens.lookup import lookup
from blockspec.services.drafter.proposers.ngram import NgramProposer


def test_lookup_prefers_longest_then_latest_match():
    ids = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    # suffix "1 2 3" occurs at 0 -> followed by 4 9 2
    assert lookup(ids, 3, max_ngram=3, min_ngram=1) == (4, 9, 2)
    # with bigrams only, the latest "2 3" (at 5) wins -> 5 6 1
    assert lookup(ids, 3, max_ngram=2, min_ngram=1) == (5, 6, 1)


def test_lookup_stops_at_context_end_and_handles_no_match():
    assert lookup([7, 8, 7], 5, 3, 1) == (8, 7)
    assert lookup([1, 2, 3], 4, 3, 1) == ()
    assert lookup([4], 4, 3, 1) == ()


def test_proposer_respects_k():
    drafts = NgramProposer().propose([ProposeInput("a", [1, 2, 3, 1, 2], 1), ProposeInput("b", [1, 1, 1], 0)])
    assert drafts[0].token_ids == (3,)
    assert drafts[1].token_ids == ()


def test_proposer_continues_a_loop_unless_told_not_to():
    loop = ProposeInput("a", [4, 1, 2, 3, 1, 2, 3, 1], 6)
    assert NgramProposer().propose([loop])[0].token_ids == (2, 3, 1, 2, 3, 1)
    assert NgramProposer(periodic=False).propose([loop])[0].token_ids == (2, 3, 1)


def _reference_lookup(ids, k, max_ngram, min_ngram):
    """The definition, spelled out: the latest start i with ids[i:i+n] == ids[-n:] and i + n < len(ids)."""
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        starts = [i for i in range(len(ids) - n) if ids[i : i + n] == ids[-n:]]
        if starts:
            return tuple(ids[starts[-1] + n : starts[-1] + n + k])
    return ()


def test_lookup_matches_its_definition_on_random_contexts():
    import random

    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(6) if rng.random() < 0.9 else rng.randrange(70_000) for _ in range(rng.randrange(1, 40))]
        k, hi = rng.randrange(1, 9), rng.randrange(1, 5)
        lo = rng.randrange(1, hi + 1)
        assert lookup(ids, k, hi, lo) == _reference_lookup(ids, k, hi, lo), (ids, k, hi, lo)


def test_periodic_lookup_continues_a_loop_past_the_context_end():
    # "8 7" after the first 7 runs into the end: the context is read as 7 8 7 8 7 ... (period 2)
    assert lookup([7, 8, 7], 5, 3, 1, periodic=True) == (8, 7, 8, 7, 8)
    # a loop of period 3: the suffix "2 3 1 2" last occurred at 1, three tokens back
    assert lookup([1, 2, 3, 1, 2, 3, 1, 2], 5, 4, 2, periodic=True) == (3, 1, 2, 3, 1)
    # a match with k tokens after it is used as it is; no match stays empty
    assert lookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], 3, 3, 1, periodic=True) == (4, 9, 2)
    assert lookup([1, 2, 3], 4, 3, 1, periodic=True) == ()
    assert lookup([5, 6, 5, 6], 3, 2, 2, periodic=True) == (5, 6, 5)


def test_context_texts_grow_with_the_committed_tokens_and_start_over_after_a_drop():
    from blockspec.common.tokens.lookup import ContextTexts, as_text

    texts, ids = ContextTexts(), [5, 6, 5]
    assert texts.of("a", ids) == as_text(ids)
    ids += [6, 7, 70_000]
    assert texts.of("a", ids) == as_text(ids)
    assert lookup(ids + [5, 6], 3, 2, 2, text=texts.of("a", ids + [5, 6])) == lookup(ids + [5, 6], 3, 2, 2) == (7, 70_000, 5)
    texts.drop("a")
    assert texts.of("a", [9, 9]) == as_text([9, 9])
    assert texts.of("b", [1]) == as_text([1]) and texts.of("a", [4]) == as_text([4])  # a shorter context: not the old one
