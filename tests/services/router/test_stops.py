import random

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


def released(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    m, out = StopMatcher(stops), []
    for chunk in chunks:
        text, hit = m.push(chunk)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_overlapping_stops_cut_where_one_character_at_a_time_would():
    """'-> None:' starts first but ends after ' No': a step that brings both at once (speculation) must cut at ' No',
    as the target alone, a token a step, does."""
    text = "def f(x) -> None:\n"
    assert released(["-> None:", " No"], list(text)) == ("def f(x) ->", True)
    assert released(["-> None:", " No"], [text]) == ("def f(x) ->", True)
    assert released(["ab", "b"], ["ab"]) == ("", True)  # ending together: the longer one's start


def test_any_chunking_releases_what_characters_one_by_one_release():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1)) // 3)) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert released(stops, chunks) == released(stops, list(text)), (text, stops, chunks)
