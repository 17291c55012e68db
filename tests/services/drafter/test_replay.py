"""ReplayProposer: another proposer's drafts recorded over one run, given back without calling it."""

from blockspec.common.contracts import ProposeInput
from blockspec.services.drafter.proposers.ngram import NgramProposer
from blockspec.services.drafter.proposers.replay import ReplayProposer


class Counting(NgramProposer):
    def __init__(self) -> None:
        super().__init__()
        self.calls, self.released = 0, []

    def propose(self, inputs):
        self.calls += 1
        return super().propose(inputs)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def test_recorded_drafts_come_back_for_the_same_context_and_k_without_the_live_proposer():
    live = Counting()
    replay = ReplayProposer(live)
    assert (replay.method, replay.max_k) == (live.method, live.max_k)
    asked = [ProposeInput("a", [1, 2, 3, 1, 2], 2), ProposeInput("b", [4, 5, 4], 1)]
    recorded = replay.propose(asked)
    assert [d.token_ids for d in recorded] == [(3, 1), (5,)] and live.calls == 1
    replay.recording = False
    again = replay.propose([ProposeInput("other id", [1, 2, 3, 1, 2], 2), ProposeInput("b", [4, 5, 4], 1)])
    assert again == recorded and live.calls == 1  # keyed by the committed tokens and k, not the request id
    assert replay.misses == 0
    # A context or a k never recorded: no draft, counted.
    missed = replay.propose([ProposeInput("a", [1, 2, 3, 1, 2], 1), ProposeInput("c", [9, 9], 2)])
    assert [d.token_ids for d in missed] == [(), ()] and replay.misses == 2 and live.calls == 1
    replay.release("a")
    assert live.released == ["a"]
