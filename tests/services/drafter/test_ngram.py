from blockspec.services.drafter.proposer import ProposeInput
from blockspec.services.drafter.proposers.ngram import NgramProposer, lookup


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
