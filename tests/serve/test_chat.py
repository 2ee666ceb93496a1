"""The plain-text chat template: known answers for the documented layout, and its refusals."""

from __future__ import annotations

import pytest

from tinylm.errors import TinyLMError
from tinylm.serve.chat import STOP, chat_prompt, reply_text


def test_the_template_written_out():
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is a token?"},
        {"role": "assistant", "content": "A piece of text."},
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "And a "}, {"type": "text", "text": "cache?"}]},
    ]
    assert chat_prompt(messages) == (
        "System: You are terse.\n"
        "User: What is a token?\n"
        "Assistant: A piece of text.\n"
        "System: Answer in French.\n"
        "User: And a cache?\n"
        "Assistant:"
    )


def test_the_stop_strings_are_the_starts_of_the_lines_the_assistant_must_not_write():
    transcript = chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    for stop in STOP:
        assert stop.lstrip("\n") in transcript and stop.startswith("\n")


def test_the_reply_starts_at_its_first_visible_character():
    assert reply_text(" Hello there.\n") == "Hello there.\n"
    assert reply_text("\n\n  ") == ""


@pytest.mark.parametrize("messages, phrase", [
    ([], "messages is empty"),
    ([{"role": "tool", "content": "x"}], "unknown message role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
])
def test_what_the_template_refuses(messages, phrase):
    with pytest.raises(TinyLMError, match=phrase):
        chat_prompt(messages)
