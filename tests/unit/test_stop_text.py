"""A request's streamed text (engine/requests.StopText): decoded a short window per token, it equals the
whole output decoded at once, and stop strings end it before them, also across token boundaries."""

from __future__ import annotations

import pytest

from shardlm.engine.requests import StopText
from shardlm.engine.text import load_tokenizer

TEXTS = ["Hello world, this is a test.\n\n  Indented  code:\n\tdef f(x): return x**2",
         "Ünïcödé — émojis 🎉🚀 and 日本語のテキスト", " leading space and trailing space "]


@pytest.fixture(scope="module")
def tok(bundled_dir):
    return load_tokenizer(bundled_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_whole_decode(tok, text):
    ids = tok(text)["input_ids"]
    st = StopText(tok, ())
    pieces = [st.push(i) for i in ids]
    assert not any(hit for _, hit in pieces)
    assert "".join(p for p, _ in pieces) + st.flush() == tok.decode(ids, skip_special_tokens=True)


def test_a_stop_string_ends_the_text_before_it(tok):
    ids = tok("The answer is 42. Then more text follows")["input_ids"]
    st = StopText(tok, ("42.",))
    out, hit = "", False
    for i in ids:
        piece, hit = st.push(i)
        out += piece
        if hit:
            break
    assert hit and out == "The answer is "
