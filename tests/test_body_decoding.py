"""A request body's JSON errors name what is wrong: a lone UTF-16 surrogate escape (valid JSON grammar, no Unicode
text) was reported by msgspec as "Input data was truncated"."""

from __future__ import annotations

import pytest

from pagoda.services.protocol.schemas import ChatBody, decode_body
from pagoda.shared.errors import InvalidRequestError


def _chat(content_json: str) -> bytes:
    """A chat body whose one message's content is `content_json` as written (escapes kept)."""
    return b'{"model": "m", "messages": [{"role": "user", "content": ' + content_json.encode() + b"}]}"


@pytest.mark.parametrize("content_json, escape", [
    ('"cut \\ud83d"', "d83d"),  # a high half at the end of the string
    ('"cut \\ud83d here"', "d83d"),  # a high half before plain text
    ('"\\ud83d\\n\\ude00"', "d83d"),  # a high half before another escape
    ('"\\ude00 alone"', "de00"),  # a low half first
    ('"\\ud83d\\ude00 then \\uDBFF"', "DBFF"),  # a pair, then a high half (upper-case digits)
    ('"\\\\\\ud800"', "d800"),  # an escaped backslash, then the escape
])
def test_an_unpaired_surrogate_is_named_with_its_offset(content_json: str, escape: str) -> None:
    body = _chat(content_json)
    with pytest.raises(InvalidRequestError) as raised:
        decode_body(body, ChatBody)
    message = str(raised.value)
    assert f"unpaired UTF-16 surrogate \\u{escape}" in message and "truncated" not in message, message
    offset = int(message.split("(byte ")[1].split(")")[0])
    assert body[offset:offset + 6].decode().lower() == "\\u" + escape.lower()


@pytest.mark.parametrize("content_json, text", [
    ('"\\ud83d\\ude00"', "\U0001F600"),  # a pair is one character
    ('"\\\\ud800"', "\\ud800"),  # an escaped backslash: the rest is plain text
])
def test_paired_surrogates_and_escaped_backslashes_decode(content_json: str, text: str) -> None:
    body = decode_body(_chat(content_json), ChatBody)
    assert body.messages[0].content == text


def test_other_json_errors_keep_the_decoders_message() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        decode_body(_chat('"open'), ChatBody)
    assert "not valid JSON" in str(raised.value) and "surrogate" not in str(raised.value)
