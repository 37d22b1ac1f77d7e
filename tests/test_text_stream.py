"""Streamed text equals the decoded ids, and stop strings never leak."""

from hypothesis import given, settings
from hypothesis import strategies as st

from runner.text import TextStream


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(3, 4095), min_size=1, max_size=60))
def test_streamed_text_equals_decoding_all_ids(engine, ids):
    stream = TextStream(engine.tokenizer)
    text = "".join(stream.add(t) for t in ids) + stream.finish()
    assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=120), st.data())
def test_stop_string_cuts_text_before_its_first_occurrence(engine, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 8))]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(engine.tokenizer, (stop,))
    out = ""
    for t in ids:
        out += stream.add(t)
        if stream.stopped:
            break
    out += stream.finish()
    full = engine.tokenizer.decode(ids)
    if stop in full:
        assert stream.stopped and out == full[: full.index(stop)]
    else:
        assert not stream.stopped and out == full
