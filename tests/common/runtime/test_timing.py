"""The timing helpers behind the cost model and adaptive k's step costs."""

from blockspec.common.runtime.timing import interleaved


def test_interleaved_runs_each_setup_just_before_its_fn():
    calls = []
    fns = {k: (lambda k=k: calls.append(("fn", k))) for k in (1, 2, 3)}
    before = {2: lambda: calls.append(("before", 2))}
    seconds = interleaved(fns, repeats=4, before=before)
    assert set(seconds) == {1, 2, 3} and all(s >= 0 for s in seconds.values())
    # An untimed round, then 4 timed ones; each round every fn once, in order, the setup right before fn 2.
    assert calls == [("fn", 1), ("before", 2), ("fn", 2), ("fn", 3)] * 5
