"""A conversation with a trained model, a turn at a time: what `tinylm chat` runs.

`ChatSession` keeps the conversation (an optional system message, then the turns: each a user message and the
assistant's reply) and answers the next user message with `ChatSession.reply`, the reply's text in pieces as
the tokens are generated. Every turn's prompt is the whole conversation so far, rendered as the server renders
the same messages (`tinylm.tokenizers.chat_format.ChatFormat`: the model's chat template, or the plain-text
transcript for a base model), so a reply in the terminal is the reply ``/v1/chat/completions`` gives for those
messages and sampling settings.

**The context.** A model reads at most its block size of tokens, and a reply needs room beside the prompt
(``max_new_tokens``; `reply_room` by default). When the conversation no longer fits, the oldest turns go first,
a whole turn at a time (a user message without the answer it got would read as a question left hanging);
the system message and the latest user message always stay. `ChatSession.dropped` says how many went for the
latest reply. Cutting tokens off the front instead, as the server does with a prompt too long, would leave the
model half a message and, with a template, no start marker. A message too long to fit even alone is refused
(`MessageTooLong`) and the conversation is left as it was, so the next, shorter message can go on.

**A reply.** It stops where the model ends its turn (the tokenizer's stop ids: EOS, ``<|im_end|>``,
``<|eot_id|>``), at the transcript's stop strings (``\\nUser:``), or after ``max_new_tokens``; its leading
whitespace is dropped (`reply_text`: a transcript's model writes the space after ``Assistant:`` itself), and
every piece is whole characters. The turn joins the history once its first piece is out, and the reply grows
with every piece, so a reply stopped early (Ctrl-C, or a caller that stops reading) stays in the conversation
as far as it was shown; one stopped before it showed anything leaves no turn behind.

**The previous turn's cache.** Each prompt begins with the last one's tokens and the reply, so the session keeps
the keys and values of the last sequence it read (`tinylm.generate.prefix_cache.PrefixCache`, one entry) and
the next turn runs the model on the tokens after the longest prefix they share: the new message, and whatever
of the reply reads differently once rendered into the transcript. ``prefix_cache=False`` recomputes every turn;
`ChatSession.prompt_tokens_run` says how many prompt tokens the latest reply ran.

    session = ChatSession(run.model, run.tokenizer, run.start_ids, system="Answer briefly.")
    for piece in session.reply("What is a token?"):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from tinylm.errors import TinyLMError
from tinylm.generate.engine import Engine
from tinylm.generate.prefix_cache import PrefixCache
from tinylm.generate.sampling import SamplingParams
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.chat_format import ChatFormat, reply_text

REPLY_TOKENS = 128  # the most tokens of a reply by default, where the context has room for it


def reply_room(context: int) -> int:
    """The default most tokens of a reply in a ``context``-token model: `REPLY_TOKENS`, or half the context where
    that is less, so a small model still holds some conversation beside the reply."""
    return max(1, min(REPLY_TOKENS, context // 2))


class MessageTooLong(TinyLMError):
    """The latest message does not fit the context beside the reply's room, even with every earlier turn dropped."""


class ChatSession:
    """One conversation with ``model`` (module docstring): its messages, and `reply` to the next one.

    ``start_ids`` go before a transcript (a run's `start_ids`); ``system`` is the system message, kept
    whatever is dropped; ``params`` the sampling (default: `SamplingParams` with `reply_room` new tokens), to
    which the transcript's stop strings are added. A reply is one sample: no beams, one sample per prompt.
    ``prefix_cache`` keeps the previous turn's keys and values for the next (module docstring).
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, start_ids: Sequence[int] = (), *,
                 system: str | None = None, params: SamplingParams | None = None, prefix_cache: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.format = ChatFormat(tokenizer, tuple(start_ids))
        self.context: int = model.config.block_size
        params = params if params is not None else SamplingParams(max_new_tokens=reply_room(self.context))
        if params.num_samples != 1 or params.num_beams != 1:
            raise TinyLMError("a chat reply is one sample: use num_samples = 1 and num_beams = 1")
        if not 1 <= params.max_new_tokens < self.context:
            raise TinyLMError(f"a reply of up to {params.max_new_tokens} tokens leaves no room for the conversation "
                              f"in the model's {self.context}-token context; ask for 1 to {self.context - 1}")
        self.params = dataclasses.replace(params, stop=(*self.format.stop, *params.stop))
        self.system: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        self.history: list[dict[str, Any]] = []  # user, assistant, user, assistant, ...
        self.dropped = 0  # the oldest turns dropped to fit the latest message
        self.last_prompt: list[int] = []  # the prompt ids of the latest reply
        self.cache = PrefixCache(None, max_entries=1) if prefix_cache else None
        self.prompt_tokens_run = 0  # the prompt tokens the latest reply ran through the model (not from the cache)
        if self.system:  # a system message too long, or a template refusing system messages, says so now
            ids = self.format.prompt_ids([*self.system, {"role": "user", "content": ""}])
            if len(ids) > self.budget:
                raise TinyLMError(f"the system message makes a prompt of {len(ids)} tokens, and the model's "
                                  f"{self.context}-token context holds {self.budget} beside the "
                                  f"{self.params.max_new_tokens} kept for the reply; shorten it or ask for a "
                                  "shorter reply")

    @property
    def budget(self) -> int:
        """The most tokens a prompt may have: the context less the reply's room."""
        return self.context - self.params.max_new_tokens

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation as the next prompt renders it, before the next user message: copies."""
        return [dict(m) for m in (*self.system, *self.history)]

    def reset(self) -> None:
        """Start over: the turns are forgotten, the system message stays."""
        self.history = []
        self.dropped = 0

    def reply(self, text: str) -> Iterator[str]:
        """The reply to the user's ``text``, in pieces as it is generated (module docstring).

        The prompt is fitted here, before the first piece: `dropped` and `last_prompt` are set when this returns,
        and a message that cannot fit raises `MessageTooLong` with the conversation unchanged.
        """
        user = {"role": "user", "content": text}
        dropped, ids = self._fit(user, self.history)
        self.dropped, self.last_prompt = dropped, ids
        return self._pieces(self.history[2 * dropped:], user, ids)

    def _fit(self, user: dict[str, Any], history: list[dict[str, Any]]) -> tuple[int, list[int]]:
        """How many of the oldest turns to drop for ``user``'s prompt to fit `budget`, and the prompt's ids."""
        for dropped in range(len(history) // 2 + 1):
            ids = self.format.prompt_ids([*self.system, *history[2 * dropped:], user])
            if len(ids) <= self.budget:
                return dropped, ids
        with_system = " with the system message" if self.system else ""
        raise MessageTooLong(f"message not sent: it makes a prompt of {len(ids)} tokens{with_system}, and the "
                             f"model's {self.context}-token context holds {self.budget} beside the "
                             f"{self.params.max_new_tokens} kept for the reply; shorten it")

    def _pieces(self, kept: list[dict[str, Any]], user: dict[str, Any], ids: list[int]) -> Iterator[str]:
        engine = Engine(self.model, self.params, self.tokenizer, long_prompts="refuse", prefix_cache=self.cache)
        assistant = {"role": "assistant", "content": ""}
        joined = False
        with contextlib.closing(engine.events([ids])) as events:  # a reply stopped early ends its decoding too
            for event in events:
                self.prompt_tokens_run = engine.prompt_tokens_run
                piece = event.text if assistant["content"] else reply_text(event.text)  # piece by piece
                if not piece:
                    continue
                if not joined:
                    self.history, joined = [*kept, user, assistant], True
                assistant["content"] += piece
                yield piece
        if not joined:  # an empty reply is still the model's answer
            self.history = [*kept, user, assistant]


__all__ = ["REPLY_TOKENS", "ChatSession", "MessageTooLong", "reply_room"]
