"""SSE framing: encoder and incremental decoder."""

from __future__ import annotations

import pytest

from agent.core.sse import SSEDecoder, SSEMessage, comment, encode


def test_encode_writes_id_event_and_one_data_line_per_line() -> None:
    assert b"id: 3\nevent: notice\ndata: a\ndata: b\n\n" == encode("notice", "a\nb", event_id=3)


def test_decoder_round_trips_messages_split_at_every_byte() -> None:
    stream = (
        encode("notice", '{"x": 1}', event_id=1) + comment("hb") + encode("cleared", "two\nlines", event_id=2)
    )
    decoder = SSEDecoder()
    messages: list[SSEMessage] = []
    for i in range(len(stream)):
        messages.extend(decoder.feed(stream[i : i + 1]))
    assert [SSEMessage("notice", '{"x": 1}', "1"), SSEMessage("cleared", "two\nlines", "2")] == messages
    assert "2" == decoder.last_event_id


@pytest.mark.parametrize("newline", [b"\r\n", b"\r", b"\n"])
def test_decoder_accepts_every_line_ending(newline: bytes) -> None:
    # A trailing comment line: a lone CR at the end of a chunk might be the first half of a CRLF.
    raw = newline.join([b"event: notice", b"data: x", b"", b":", b""])
    assert [SSEMessage("notice", "x")] == SSEDecoder().feed(raw)


def test_decoder_ignores_comments_and_unknown_fields() -> None:
    assert [] == SSEDecoder().feed(b": heartbeat\n\nfoo: bar\n\n")


def test_decoder_refuses_an_unbounded_line() -> None:
    with pytest.raises(ValueError, match="longer than"):
        SSEDecoder(max_buffer=100).feed(b"data: " + b"x" * 200)


def test_event_name_must_be_one_line() -> None:
    with pytest.raises(ValueError):
        encode("a\nb", "x")
