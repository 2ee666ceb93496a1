"""A tokenizer's chat template: messages written out the way the model was tuned to read them.

A model tuned on conversations (Llama 3 Instruct, Qwen2 Instruct, Llama 2 Chat) comes with a Jinja
template in its tokenizer_config.json (or chat_template.jinja) that writes a list of messages as
text with the family's markers: ``<|start_header_id|>user<|end_header_id|>\\n\\nHi<|eot_id|>``,
``<|im_start|>user\\nHi<|im_end|>\\n``, ``<s>[INST] Hi [/INST]``. `render_chat` renders it as
`transformers`' ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` does,
so the model reads the prompt it was tuned on:

- a sandboxed environment (`ImmutableSandboxedEnvironment`: a template is code from a download,
  and must not reach Python's internals or change the objects it is given), ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``);
- a ``tojson`` filter that writes non-ASCII as is (Jinja's own escapes it, and HTML characters);
  ``raise_exception(message)`` (a template's way to refuse a conversation: `ChatTemplateError`)
  and ``strftime_now(format)`` (Llama 3.1 writes today's date);
- the variables ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None), and the
  tokenizer's special tokens by role: ``bos_token``, ``eos_token``, ``pad_token``, and ``unk_token``
  where it has one. One difference: where the files name no bos or pad token, tinylm's roles use
  eos for them (`tinylm.tokenizers.hf_files`), so ``bos_token`` is eos's name where `transformers`
  leaves it undefined (an empty string); the templates of such families (Qwen2's ChatML) do not
  write it.

`chat_prompt_ids` encodes the rendered text with the special tokens the template wrote read as
special tokens and nothing put in front: the template writes BOS itself where the model wants it.
These are ``apply_chat_template(..., tokenize=True)``'s ids.

`turn_end_ids` finds the token a template writes at the end of an assistant's message (Llama 3's
``<|eot_id|>``, ChatML's ``<|im_end|>``): a tuned model ends its reply with it, so generation stops
there as at eos.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import CHAT_END, CHAT_START, Tokenizer, tokenizer_from_dict


class ChatTemplateError(TinyLMError):
    """The template refused the messages (its ``raise_exception``) or failed on them."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _plain_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace()``, refusing names that start with "_" (no way to reach dunder attributes)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the environment `transformers` renders chat templates in (cached by text)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_plain_dict,
                       namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template is not valid Jinja (line {e.lineno}: {e.message})") \
            from None


def special_token_variables(tokenizer: Tokenizer) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ``pad_token`` (and ``unk_token``): the names a template writes them by."""
    names = {f"{role}_token": name for role, name in tokenizer.roles.items()}
    unk = getattr(tokenizer, "unk", None)
    if unk:
        names["unk_token"] = unk
    return names


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], variables: Mapping[str, str], *,
                add_generation_prompt: bool = True) -> str:
    """``messages`` written out by ``template``; ``variables``: the special tokens' names (`special_token_variables`).

    A key whose value is None is left out of its message, as `transformers` does (templates test whether a
    key is there). A template that does not compile, refuses the messages or fails on them is a
    `ChatTemplateError` of one line.
    """
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    compiled = compile_template(template)
    try:
        return compiled.render(messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.exceptions.TemplateError as e:  # raise_exception, an undefined variable, the sandbox
        raise ChatTemplateError(f"the model's chat template refused these messages: {_one_line(e.message)}") from None
    except Exception as e:  # the template is foreign code: `"a" + 1`, a method of the wrong type
        raise ChatTemplateError(f"the model's chat template failed on these messages: {type(e).__name__}: "
                                f"{_one_line(str(e))}") from None


def _one_line(message: str | None) -> str:
    return " ".join((message or "no reason given").split())


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt for ``messages`` through the tokenizer's chat template (which it must have), as token ids."""
    text = render_chat(tokenizer.chat_template, messages, special_token_variables(tokenizer))
    return tokenizer.encode(text, allowed_special="all")


# A probe conversation: the text after the assistant's content is what the template closes a turn with.
_REPLY = "Fine, thanks."
_PROBES = ([{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": _REPLY}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"},
            {"role": "assistant", "content": _REPLY}])


def turn_end_ids(template: str, special_tokens: Mapping[str, int], variables: Mapping[str, str]) -> list[int]:
    """The special token the template writes right after an assistant's message (whitespace between allowed):
    ``<|eot_id|>``, ``<|im_end|>``, ``</s>``; [] when it writes none there, or refuses both probe conversations
    (or does not compile: the tokenizer is still good for text).
    """
    by_length = sorted(special_tokens, key=len, reverse=True)
    for probe in _PROBES:
        try:
            text = render_chat(template, probe, variables, add_generation_prompt=False)
        except ChatTemplateError:
            continue
        at = text.rfind(_REPLY)
        if at < 0:
            return []
        after = text[at + len(_REPLY):].lstrip()
        return [special_tokens[name] for name in by_length if after.startswith(name)][:1]
    return []


# ChatML, as OpenAI wrote it down and Qwen, llama.cpp and transformers all read it: every message is
# <|im_start|>role, a newline, its content, <|im_end|> and a newline; the prompt for a reply ends with
# <|im_start|>assistant and a newline. The roles are plain text, the two markers special tokens.
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")
OWN_KINDS = ("bpe", "char", "word")  # tinylm's own tokenizers, whose special tokens follow the base vocabulary


def with_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer a model is fine-tuned on conversations with: ``tokenizer`` itself when it has a chat template
    (an imported chat model keeps its own), else a copy with ChatML's two markers added as special tokens (ids
    after every other, so the model grows by two rows) and `CHATML_TEMPLATE`."""
    if tokenizer.chat_template is not None:
        return tokenizer
    if tokenizer.kind not in OWN_KINDS:
        raise TinyLMError(f"this imported {tokenizer.kind} tokenizer has no chat template, and tinylm adds one to its "
                          "own tokenizers only; import the model's chat (instruct) version, whose files carry one")
    copy = tokenizer_from_dict(tokenizer.to_dict())
    copy._add_chat_tokens([CHAT_START, CHAT_END], CHATML_TEMPLATE)
    return copy


def training_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
    """A conversation as its token ids through the tokenizer's chat template, and for each id whether the model
    learns to write it: the assistant's messages and the end-of-turn token that closes each, nothing else.

    The ids are exactly what `chat_prompt_ids` gives for the whole conversation (what the model reads when it
    serves), so training and serving see the same tokens. Which characters the assistant writes is found by
    rendering the conversation up to each assistant message: with the generation prompt (what comes before its
    reply) and through the message (whitespace after its end-of-turn token is the template's, never generated).
    A template that does not write a conversation as its turns one after the other cannot be split so, and is
    refused.
    """
    variables = special_token_variables(tokenizer)
    template = tokenizer.chat_template
    text = render_chat(template, messages, variables, add_generation_prompt=False)
    spans = []  # (start, end) byte offsets of what the assistant writes
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render_chat(template, messages[:i], variables, add_generation_prompt=True)
        through = render_chat(template, messages[:i + 1], variables, add_generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ChatTemplateError("the chat template does not write a conversation as its turns one after the "
                                    "other, so the assistant's part cannot be told apart for training")
        spans.append((len(before.encode("utf-8")), len(through.rstrip().encode("utf-8"))))
    ids = tokenizer.encode(text, allowed_special="all")
    trained, at = [], 0
    for token in ids:
        end = at + len(tokenizer.token_bytes(token))
        trained.append(any(at < stop and end > start for start, stop in spans))
        at = end
    if at != len(text.encode("utf-8")):
        raise ChatTemplateError(f"this {tokenizer.kind} tokenizer's tokens do not spell the chat text byte for byte, "
                                "so the assistant's tokens cannot be found; fine-tuning on chats needs a byte-level "
                                "tokenizer")
    return ids, trained


__all__ = ["CHATML_TEMPLATE", "ChatTemplateError", "chat_prompt_ids", "compile_template", "render_chat",
           "special_token_variables", "training_ids", "turn_end_ids", "with_chat_tokens"]
