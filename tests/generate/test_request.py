"""One request's rules (`tinylm.generate.request`): the prompts, the stop ids and the ids no sample draws, as the
engine, speculative decoding and the server read them."""

from __future__ import annotations

import pytest
import torch
from toys import tiny_gpt

from tinylm.errors import TinyLMError
from tinylm.generate import SamplingParams, generate, stream
from tinylm.generate.request import RequestRules
from tinylm.generate.sampling import excluded_mask
from tinylm.generate.steps import fit_prompt


def test_a_long_prompt_is_read_whole_cut_or_refused_as_the_caller_says():
    model = tiny_gpt(block_size=16)
    rules = RequestRules(model, None)
    long = list(range(20))
    assert rules.prompts([long]) == ([long], [])  # the engine's window slides
    cut, said = rules.prompts([long], "cut")
    assert (cut[0], said[0]) == fit_prompt(long, 16)
    assert rules.prompts([long[:10]], "refuse", max_new_tokens=6) == ([long[:10]], [])
    with pytest.raises(TinyLMError, match="prompt 1 has 10 tokens; with 7 new ones it exceeds the model's context"):
        rules.prompts([[1], long[:10]], "refuse", max_new_tokens=7)


def test_prompts_must_hold_ids_of_the_vocabulary_they_are_read_in(byte_tokenizer):
    model = tiny_gpt(vocab_size=300)  # wider than the tokenizer (259 ids)
    for prompt_vocab, name, size in [("model", "the model's vocabulary", 300), ("tokenizer", "the vocabulary", 259)]:
        rules = RequestRules(model, byte_tokenizer, prompt_vocab=prompt_vocab)
        with pytest.raises(TinyLMError, match=f"prompt 0 holds ids outside {name} 0..{size - 1}"):
            rules.prompts([[size]])
        with pytest.raises(TinyLMError, match="prompt 1 is empty"):
            rules.prompts([[1], []])


def test_stop_ids_are_the_requests_own_else_the_tokenizers_and_each_set_has_one_mask(byte_tokenizer):
    model = tiny_gpt(vocab_size=300)
    rules = RequestRules(model, byte_tokenizer)
    default = rules.prepare([[1]], SamplingParams())
    own = rules.prepare([[1]], SamplingParams(stop_ids=[byte_tokenizer.pad_id]))
    assert default.stop_ids == {byte_tokenizer.eos_id} and own.stop_ids == {byte_tokenizer.pad_id}
    assert torch.equal(default.excluded, excluded_mask(byte_tokenizer, 300, {byte_tokenizer.eos_id}))
    assert not own.excluded[byte_tokenizer.pad_id] and default.excluded[byte_tokenizer.pad_id]
    assert rules.prepare([[2]], SamplingParams()).excluded is default.excluded  # kept: one tensor per set
    with pytest.raises(TinyLMError, match="stop strings need a tokenizer"):
        RequestRules(model, None).stop_ids(SamplingParams(stop=["x"]))


def test_a_draft_gets_a_mask_even_where_nothing_is_left_out():
    request = RequestRules(tiny_gpt(), None).prepare([[1]], SamplingParams())
    assert request.excluded is None
    assert request.draft_mask().shape == (97,) and not request.draft_mask().any()


def test_generate_and_stream_refuse_a_compiled_step_with_beam_search(byte_tokenizer):
    model, beams = tiny_gpt(vocab_size=259), SamplingParams(num_beams=2, max_new_tokens=2)
    with pytest.raises(TinyLMError, match="--compile .* beam search"):
        generate(model, byte_tokenizer, "a", beams, compile=True)
    with pytest.raises(TinyLMError, match="--compile .* beam search"):
        list(stream(model, byte_tokenizer, "a", beams, compile=True))
    assert len(generate(model, byte_tokenizer, "a", beams)) == 1  # without compile, beam search runs
