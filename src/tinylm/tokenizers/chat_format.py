"""How a conversation becomes a prompt: the model's chat template, or a plain-text transcript.

This is the one rendering of a chat, shared by everything that talks to a model in turns: the server's
``/v1/chat/completions`` (`tinylm.serve.chat`) and `tinylm chat` (`tinylm.generate.chat`). It lives with the
tokenizers, below both, because it needs nothing but a tokenizer, so a reply in the terminal and a reply over
HTTP read the very same prompt ids.

**A model with a chat template** (one imported from Hugging Face that was tuned on conversations, or a run
fine-tuned by `tinylm finetune`: its tokenizer has a ``chat_template``) reads its messages as it was tuned to:
`tinylm.tokenizers.chat_template.chat_prompt_ids`, ``apply_chat_template(messages, add_generation_prompt=True,
tokenize=True)``'s ids, nothing put in front (the template writes BOS where the model wants it). The reply ends
where the model ends its turn, at a stop token (`tinylm.tokenizers.base.default_stop_ids`); there are no stop
strings.

**A base model** (tinylm's own, and any without a template) continues text and has no chat tokens, so a chat is
written out as a transcript, one ``Role: content`` line per message, and the model is asked to continue the
assistant's line::

    System: You are a helpful assistant.
    User: What is a token?
    Assistant: A piece of text the model reads.
    User: And a KV cache?
    Assistant:

- The roles are written ``System``, ``User`` and ``Assistant`` (``developer``, the newer name for system
  messages, is written ``System`` too); any other role is refused: a base model has no tool calls. Content is a
  string or a list of ``{"type": "text", "text": ...}`` parts, which are joined; any other part is refused.
- The prompt ends with ``Assistant:`` and no space. Byte-level BPE attaches a space to the word after it
  (" Hello" is one token), so a trailing space would leave the model a token boundary it rarely saw in training;
  instead the model writes the space itself and the reply's leading whitespace is dropped (`reply_text`).
- Generation stops at ``\\nUser:`` or ``\\nSystem:`` (`STOP`): the start of a line the assistant should not
  write.
- Content is written as it is, newlines included: a message holding ``"\\nAssistant: ..."`` reads, to the
  model, like another turn. A transcript is not a security boundary; a model tuned on chats marks turns with
  special tokens instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.chat_template import chat_prompt_ids

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
STOP = ("\nUser:", "\nSystem:")
ASSISTANT_PREFIX = "Assistant:"


def message_text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's content as text: the string itself, or its text parts joined; None is ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TinyLMError(f"a tinylm model reads text only: content parts must be {{'type': 'text', 'text': ...}}, "
                              f"got a part of type {part.get('type')!r}")
        texts.append(part["text"])
    return "".join(texts)


def _require_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise TinyLMError("messages is empty: give at least one message, e.g. {'role': 'user', 'content': 'Hi'}")


def chat_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The transcript of ``messages`` (dicts with ``role`` and ``content``) that the model continues."""
    _require_messages(messages)
    lines = []
    for message in messages:
        role = message.get("role")
        if role not in ROLE_NAMES:
            raise TinyLMError(f"unknown message role {role!r}; a base model's transcript has "
                              f"{', '.join(sorted(ROLE_NAMES))} messages")
        lines.append(f"{ROLE_NAMES[role]}: {message_text(message.get('content'))}\n")
    return "".join(lines) + ASSISTANT_PREFIX


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chats become prompt ids: its tokenizer's chat template, or the transcript.

    ``start_ids`` go before a transcript (a run's `start_ids`: what its documents began after in training); a
    template writes its own start and ignores them.
    """

    tokenizer: Tokenizer
    start_ids: Sequence[int]

    @property
    def template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)  # a base model's tokenizer has none

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings besides a request's own: the transcript's next lines; none with a template."""
        return () if self.template else STOP

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt for ``messages`` (dicts with ``role`` and ``content``) as token ids."""
        if not self.template:
            return list(self.start_ids) + self.tokenizer.encode(chat_prompt(messages))
        _require_messages(messages)
        joined = [{**m, "content": None if m.get("content") is None else message_text(m["content"])}
                  for m in messages]
        return chat_prompt_ids(self.tokenizer, joined)


def reply_text(completion: str) -> str:
    """The assistant's message from the model's continuation: without the whitespace after ``Assistant:``."""
    return completion.lstrip()


__all__ = ["ASSISTANT_PREFIX", "ROLE_NAMES", "STOP", "ChatFormat", "chat_prompt", "message_text", "reply_text"]
