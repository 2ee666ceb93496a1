"""How `/v1/chat/completions` turns a list of messages into a prompt: the model's chat template, or a transcript.

The rendering is `tinylm.tokenizers.chat_format`'s (`ChatFormat`, `chat_prompt`, `STOP`, `reply_text`, named
here too), shared with `tinylm chat`, so a conversation in the terminal reads the prompt ids the server reads.

**A model with a chat template** (one imported from Hugging Face that was tuned on conversations:
its tokenizer has a ``chat_template``) reads its messages as it was tuned to: the template renders them
as `transformers`' ``apply_chat_template(messages, add_generation_prompt=True)`` does
(`tinylm.tokenizers.chat_template`), the special tokens it writes are encoded as special tokens, and
nothing is put in front (the template writes BOS where the model wants it). The reply ends where the
model ends its turn: at eos or at one of the tokenizer's other stop tokens (Llama 3's ``<|eot_id|>``,
ChatML's ``<|im_end|>``: `tinylm.tokenizers.base.default_stop_ids`), and at the request's own stop
strings; there are no stop strings of tinylm's. A template that refuses the messages (its
``raise_exception``: "roles must alternate") is a 400 with its message. Content given as text parts is
joined to one string first; the template sees ``role`` (as sent: ``developer`` stays ``developer``) and
``content`` (and ``name`` when given).

**A base model** (tinylm's own, and any without a template) continues text, was never tuned on
conversations, and has no special chat tokens. So a chat is written out as a plain-text transcript,
one message per line, and the model is asked to continue the assistant's line::

    System: You are a helpful assistant.
    User: What is a token?
    Assistant: A piece of text the model reads.
    User: And a KV cache?
    Assistant:

- Each message is ``Role: content`` followed by a newline; the roles are written ``System``,
  ``User`` and ``Assistant`` (``developer`` messages, the newer name for system messages, are
  written ``System`` too). Content may be a string or a list of ``{"type": "text", "text": ...}``
  parts, which are joined; any other part (an image, audio) is refused.
- The prompt ends with ``Assistant:`` and no space. Byte-level BPE tokenizers attach a space to
  the word after it (" Hello" is one token), so a trailing space would leave the model a
  token boundary it rarely saw in training; instead the model writes the space itself and the
  reply's leading whitespace is dropped (`reply_text`). Its ``logprobs`` start where the reply
  does: the whitespace-only tokens before the first visible character are left out
  (`is_blank_token`), and the first token kept is listed whole (" Hello", space included).
- Generation stops at ``\\nUser:`` or ``\\nSystem:`` (`STOP`), the start of a line the assistant
  should not write, besides the request's own stop strings and the end-of-text token. The reply's
  logprobs end where its text does: the tokens that only make up the stop string are not listed.

- Other roles (``tool``, ``function``) are refused with a 400: a base model has no tool calls.
- Content is written as it is, newlines included: a message holding ``"\\nAssistant: ..."``
  reads, to the model, like another turn. The template is a plain transcript, not a security
  boundary; a model tuned on chats would mark turns with special tokens instead.
- A last message from the assistant is not continued: the prompt still ends with a new
  ``Assistant:`` line (send the text as a completion's ``prompt`` to continue it).

Either way the reply's leading whitespace is dropped (`reply_text`), and nothing else is hidden: the
prompt is exactly `ChatFormat.prompt_ids` (with a template: ``apply_chat_template(..., tokenize=True)``;
without: the start ids and `chat_prompt(messages)`), and a completion request with that prompt and
those stop strings gives the same text (before the leading whitespace is dropped). `POST /tokenize`
with ``messages`` shows its tokens.
"""

from __future__ import annotations

# the rendering itself is the tokenizers' (`tinylm.tokenizers.chat_format`), so that `tinylm chat`, below the
# server, reads the same prompt ids; its names are here too, where the server's modules have always found them
from tinylm.tokenizers.chat_format import (
    ASSISTANT_PREFIX,
    ROLE_NAMES,
    STOP,
    ChatFormat,
    chat_prompt,
    message_text,
    reply_text,
)


def is_blank_token(data: bytes) -> bool:
    """Whether a token's bytes are whitespace alone (what `reply_text` drops at the start of a reply).

    A token that is part of a character (bytes that do not decode) is not blank: it begins a visible one.
    """
    try:
        return data.decode("utf-8").strip() == ""
    except UnicodeDecodeError:
        return False


__all__ = ["ASSISTANT_PREFIX", "ROLE_NAMES", "STOP", "ChatFormat", "chat_prompt", "is_blank_token", "message_text",
           "reply_text"]
