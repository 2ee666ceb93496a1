"""Chat tokens for tinylm's own tokenizers: ChatML's markers added as special tokens, the template that writes
them, and which tokens of a conversation a fine-tuned model learns to write.

Oracles: `transformers`' ``apply_chat_template`` on the same tokenizer (through the Hugging Face tokenizer.json
tinylm writes) for the ids; masks worked out by hand with a character tokenizer, where every token is one
character; properties over conversations.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch

from tinylm.errors import TinyLMError
from tinylm.model.grow import grow_vocabulary
from tinylm.tokenizers import CharTokenizer, train_bpe
from tinylm.tokenizers.base import CHAT_END, CHAT_START, default_stop_ids, generation_excluded, tokenizer_from_dict
from tinylm.tokenizers.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplateError,
    chat_prompt_ids,
    training_ids,
    with_chat_tokens,
)
from tinylm.tokenizers.formats import to_hf_tokenizer_json

import transformers

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\nAll:\nSpeak, speak. 0123456789 + = ?\n"
        "What is the sum? Spell it: w a t e r. Café, naïve, 東京.\n") * 20
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "Spell water."},
        {"role": "assistant", "content": "w a t e r, café"}]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([TEXT], vocab_size=320, pattern="gpt4", workers=1)


def test_chat_tokens_follow_every_other_id_and_survive_the_file(bpe):
    chat = with_chat_tokens(bpe)
    assert chat.vocab_size == bpe.vocab_size + 2
    assert chat.special_tokens[CHAT_START] == bpe.vocab_size and chat.special_tokens[CHAT_END] == bpe.vocab_size + 1
    assert chat.chat_template == CHATML_TEMPLATE and bpe.chat_template is None  # the original is untouched
    again = tokenizer_from_dict(json.loads(json.dumps(chat.to_dict())))
    assert again.special_tokens == chat.special_tokens and again.chat_template == CHATML_TEMPLATE
    assert again.fingerprint() == chat.fingerprint() != bpe.fingerprint()
    assert "chat" not in bpe.to_dict()  # a tokenizer without chat tokens is written as before
    assert with_chat_tokens(chat) is chat  # a tokenizer with a template keeps its own


def test_the_end_of_turn_token_stops_a_reply_and_the_start_marker_is_never_drawn(bpe):
    chat = with_chat_tokens(bpe)
    assert default_stop_ids(chat) == {chat.eos_id, chat.special_tokens[CHAT_END]}
    excluded = generation_excluded(chat)
    assert chat.special_tokens[CHAT_START] in excluded and chat.special_tokens[CHAT_END] not in excluded


def test_chat_ids_are_transformers_apply_chat_template_ids(bpe):
    chat = with_chat_tokens(bpe)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(json.dumps(to_hf_tokenizer_json(chat))),
        bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = chat.chat_template
    for messages in (CHAT[:2], CHAT[:4], CHAT[1:2]):
        ours = chat_prompt_ids(chat, messages)
        theirs = fast.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours == list(theirs)
    whole, _ = training_ids(chat, CHAT)
    theirs = fast.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert whole == list(theirs)


def test_the_trained_tokens_of_a_small_chat_worked_out_by_hand():
    chars = with_chat_tokens(CharTokenizer.train("abcdefghijklmnopqrstuvwxyz\n ?"))
    ids, trained = training_ids(chars, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    pieces = [chars.token_bytes(i).decode() for i in ids]
    # <|im_start|> u s e r \n h i <|im_end|> \n <|im_start|> a s s i s t a n t \n y o <|im_end|> \n
    assert "".join(pieces) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert [p for p, t in zip(pieces, trained) if t] == ["y", "o", "<|im_end|>"]
    assert trained[-4:] == [True, True, True, False]  # the newline after the end of the turn is the template's


def test_every_assistant_turn_is_learned_and_nothing_the_user_writes(bpe):
    chat = with_chat_tokens(bpe)
    ids, trained = training_ids(chat, CHAT)
    learned = b"".join(chat.token_bytes(i) for i, t in zip(ids, trained) if t).decode()
    assert learned == "5<|im_end|>w a t e r, café<|im_end|>"
    # another user message changes no trained token and no flag among them
    other = [dict(m) for m in CHAT]
    other[3]["content"] = "Please spell the word water, with spaces between the letters."
    ids2, trained2 = training_ids(chat, other)
    assert [i for i, t in zip(ids2, trained2) if t] == [i for i, t in zip(ids, trained) if t]
    assert sum(trained2) == sum(trained)


def test_a_template_that_does_not_write_turns_in_order_is_refused(bpe):
    chat = with_chat_tokens(bpe)
    chat.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="one after the other"):
        training_ids(chat, CHAT)


def test_chat_tokens_are_refused_when_taken_or_malformed(bpe):
    chat = with_chat_tokens(bpe)
    with pytest.raises(TinyLMError, match="already has"):
        chat._add_chat_tokens([CHAT_END], CHATML_TEMPLATE)
    with pytest.raises(TinyLMError, match="distinct"):
        tokenizer_from_dict(bpe.to_dict())._add_chat_tokens(["<|a|>", "<|a|>"], CHATML_TEMPLATE)


def test_new_vocabulary_rows_start_as_the_mean_of_the_learned_ones():
    E = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    head = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    grown = grow_vocabulary({"E.weight": E, "lm_head.weight": head, "other": torch.ones(3)}, 4)
    assert grown["E.weight"].tolist() == [[1, 2], [3, 6], [2, 4], [2, 4]]
    assert grown["lm_head.weight"].tolist() == [[0, 1], [2, 3], [1, 2], [1, 2]]
    assert grown["other"] is not None and grown["other"].tolist() == [1, 1, 1]
    with pytest.raises(TinyLMError, match="cannot shrink"):
        grow_vocabulary({"E.weight": E}, 1)
