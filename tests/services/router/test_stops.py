from blockspec.services.router.stops import StopMatcher


def test_stop_sequence_split_across_deltas_is_never_released():
    m = StopMatcher(["\n\n", "END"])
    out = []
    for delta in ["def f():", "\n    return 1\n", "\nmore"]:
        text, hit = m.push(delta)
        out.append(text)
        if hit:
            break
    assert hit and "".join(out) == "def f():\n    return 1"


def test_no_stop_releases_everything_eventually():
    m = StopMatcher(["STOP"])
    released = "".join(m.push(d)[0] for d in ["ab", "cS", "TO", "x"]) + m.flush()
    assert released == "abcSTOx"
    plain = StopMatcher([])
    assert plain.push("abc") == ("abc", False) and plain.flush() == ""
