from blockspec.common.tokens.detokenize import TextStream, decode


def test_stream_deltas_concatenate_to_the_full_text(tokenizer):
    text = "naïve café — 東京 🚀 def f(x):\n    return x ** 2\n"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push([t]) for t in ids] + [stream.flush()]
    assert "".join(pieces) == decode(tokenizer, ids) == text
    # No delta ever carries half a character.
    assert all("\ufffd" not in p for p in pieces)
