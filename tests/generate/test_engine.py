"""The engine against the naive reference: cache, batches, seeds, stopping, the context window."""

from __future__ import annotations

import warnings

import pytest
import torch

from tinylm.errors import TinyLMError
from tinylm.generate.engine import Engine, context_start, generate
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.tokenizers import BPETokenizer

from toys import BigramLM, ScriptedLM, tiny_gpt

POSITIONS = ["learned", "sinusoidal", "rope", "none"]
KV_HEADS = {"MHA": 4, "GQA": 2, "MQA": 1}
GREEDY = SamplingParams(max_new_tokens=110, temperature=0)


def assert_same_completions(a, b, logprob_tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert (x.finish_reason, x.stop, x.text) == (y.finish_reason, y.stop, y.text)
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=logprob_tol, rtol=0)


# ----- the cache gives the reference's tokens ------------------------------------------------------


@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("positions", POSITIONS)
def test_cached_greedy_generation_equals_the_reference_for_110_steps(positions, heads):
    model = tiny_gpt(positions=positions, n_kv_head=KV_HEADS[heads])
    prompt = [[3, 14, 15, 92, 65, 35, 89]]
    cached = Engine(model, GREEDY).generate(prompt)
    naive = reference_generate(model, prompt, GREEDY)
    assert_same_completions(cached, naive)
    assert len(cached[0].token_ids) == 110 and cached[0].finish_reason == "length"
    assert len(set(cached[0].token_ids)) >= 5  # a varied continuation, not one token repeated


@pytest.mark.parametrize("options", [{"bigram_hash": 101}, {"value_embed": True, "qk_norm": True, "mlp": "relu2",
                                                            "logit_softcap": 3.0}])
def test_cached_generation_equals_the_reference_with_the_recipe_options(options):
    model = tiny_gpt(positions="rope", n_kv_head=2, **options)
    if "bigram_hash" in options:
        with torch.no_grad():
            model.bigram.weight.normal_(0, 1.0)  # it starts at zero; a table that matters
    prompts = [[3, 14, 15, 92, 65, 35, 89], [7, 7]]
    cached = Engine(model, GREEDY).generate(prompts)
    assert_same_completions(cached, reference_generate(model, prompts, GREEDY))
    params = SamplingParams(max_new_tokens=40, temperature=0.9, top_k=20, seed=3, num_samples=2)
    assert_same_completions(Engine(model, params).generate(prompts), reference_generate(model, prompts, params))


def test_a_sliding_window_model_generates_past_its_window_as_the_reference_does():
    """Mistral's window (here 6 positions) in the cache: each step attends to the last 6 keys only; with a
    left-padded batch the padding must not count against a row's window either."""
    model = tiny_gpt(positions="rope", n_kv_head=2, sliding_window=6, bias=False, qkv_bias=True)
    prompts = [[3, 14, 15, 92, 65, 35, 89], [7, 7]]
    params = SamplingParams(max_new_tokens=40, temperature=0)
    cached = Engine(model, params).generate(prompts)
    assert_same_completions(cached, reference_generate(model, prompts, params))
    assert_same_completions(cached[1:], Engine(model, params).generate(prompts[1:]))  # as if alone
    unwindowed = tiny_gpt(positions="rope", n_kv_head=2, bias=False, qkv_bias=True)
    assert Engine(unwindowed, params).generate(prompts)[0].token_ids != cached[0].token_ids


def test_a_bigram_model_whose_cache_forgets_the_last_token_is_caught(monkeypatch):
    model = tiny_gpt(positions="rope", bigram_hash=101)
    with torch.no_grad():
        model.bigram.weight.normal_(0, 1.0)
    prompt = [[3, 14, 15, 92, 65, 35, 89]]
    expected = reference_generate(model, prompt, GREEDY)[0].token_ids
    from tinylm.generate.cache import KVCache

    monkeypatch.setattr(KVCache, "last_tokens", property(lambda self: None, lambda self, value: None), raising=False)
    assert Engine(model, GREEDY).generate(prompt)[0].token_ids != expected


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope"])
def test_the_comparison_catches_a_cache_that_gets_positions_wrong(positions, monkeypatch):
    """The equality above has teeth: an engine that feeds every new token at position 0 is caught."""
    model = tiny_gpt(positions=positions)
    prompt = [[3, 14, 15, 92, 65, 35, 89]]
    original = Engine._step

    def wrong_positions(self, tokens):
        self.decoder.next_position = torch.zeros_like(self.decoder.next_position)
        return original(self, tokens)

    monkeypatch.setattr(Engine, "_step", wrong_positions)
    assert Engine(model, GREEDY).generate(prompt)[0].token_ids != reference_generate(model, prompt, GREEDY)[0].token_ids


def test_sampled_generation_equals_the_reference_with_the_same_seed():
    model = tiny_gpt(positions="learned", n_kv_head=2)
    params = SamplingParams(max_new_tokens=40, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=7,
                            num_samples=3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert_same_completions(Engine(model, params).generate(prompts), reference_generate(model, prompts, params))


# ----- batches of different lengths ----------------------------------------------------------------


@pytest.mark.parametrize("positions", POSITIONS)
def test_a_batch_of_mixed_length_prompts_equals_the_prompts_run_one_by_one(positions):
    model = tiny_gpt(positions=positions, n_kv_head=2)
    prompts = [[7], [1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [42, 43, 44]]
    params = SamplingParams(max_new_tokens=30, temperature=0)
    together = Engine(model, params).generate(prompts)
    alone = [Engine(model, params).generate([p])[0] for p in prompts]
    for i, c in enumerate(together):
        c.prompt_index = 0  # the only field allowed to differ
    assert_same_completions(together, alone)


def test_rows_that_stop_early_do_not_disturb_the_others():
    model = tiny_gpt(positions="rope")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    free = Engine(model, SamplingParams(max_new_tokens=30, temperature=0)).generate(prompts)
    stop_token = free[0].token_ids[4]  # row 0 will stop at its 5th token
    params = SamplingParams(max_new_tokens=30, temperature=0, stop_ids=[stop_token])
    stopped = Engine(model, params).generate(prompts)
    first = free[0].token_ids.index(stop_token)
    assert stopped[0].token_ids == free[0].token_ids[: first + 1] and stopped[0].finish_reason == "stop"
    if stop_token not in free[1].token_ids:
        assert stopped[1].token_ids == free[1].token_ids
    assert_same_completions(stopped, reference_generate(model, prompts, params))


# ----- seeds ------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_text_whatever_ran_before(byte_tokenizer):
    model = tiny_gpt(vocab_size=byte_tokenizer.vocab_size, positions="learned")
    params = SamplingParams(max_new_tokens=25, seed=1234, num_samples=4)
    first = generate(model, byte_tokenizer, ["Once upon", "a"], params)
    torch.manual_seed(999)
    torch.randn(100)  # move the global generator: it must not matter
    generate(model, byte_tokenizer, ["something else"], SamplingParams(max_new_tokens=5, seed=5))
    second = generate(model, byte_tokenizer, ["Once upon", "a"], params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first}) == 8  # every sample of the batch differs
    other = generate(model, byte_tokenizer, ["Once upon", "a"], SamplingParams(max_new_tokens=25, seed=1235,
                                                                              num_samples=4))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_completions_come_prompt_by_prompt_with_their_sample_index(byte_tokenizer):
    model = tiny_gpt(vocab_size=byte_tokenizer.vocab_size)
    out = generate(model, byte_tokenizer, ["x", "y"], SamplingParams(max_new_tokens=3, seed=0, num_samples=2))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ----- stopping ------------------------------------------------------------------------------------------


def scripted(tokenizer, prompt: str, then: str, extra: list[int] = ()) -> tuple[ScriptedLM, list[int]]:
    """A model that continues ``prompt`` with exactly ``then`` (and the ``extra`` ids), and the prompt's ids."""
    ids = tokenizer.encode(prompt)
    return ScriptedLM(ids + tokenizer.encode(then) + list(extra), tokenizer.vocab_size), ids


def test_eos_stops_with_the_id_kept_in_the_tokens_and_left_out_of_the_text(byte_tokenizer):
    model, prompt = scripted(byte_tokenizer, "Q:", " yes", [byte_tokenizer.eos_id])
    (c,) = Engine(model, SamplingParams(max_new_tokens=20, temperature=0), byte_tokenizer).generate([prompt])
    assert c.text == " yes" and c.finish_reason == "stop" and c.stop == byte_tokenizer.eos_id
    assert c.token_ids == byte_tokenizer.encode(" yes") + [byte_tokenizer.eos_id]
    assert len(c.logprobs) == len(c.token_ids) and all(lp > -1e-3 for lp in c.logprobs)  # the toy is sure


def test_the_token_limit_finishes_with_length(byte_tokenizer):
    model, prompt = scripted(byte_tokenizer, "Q:", " a long answer")
    (c,) = Engine(model, SamplingParams(max_new_tokens=4, temperature=0), byte_tokenizer).generate([prompt])
    assert c.text == " a l" and c.finish_reason == "length" and c.stop is None
    (c,) = Engine(model, SamplingParams(max_new_tokens=0), byte_tokenizer).generate([prompt])
    assert (c.text, c.token_ids, c.finish_reason) == ("", [], "length")


@pytest.mark.parametrize("stop, expected", [
    ("\n\n", "Hello world"),  # two tokens (bytes) long: completed by the second
    ("世界", "Hello world\n\nBye "),  # six bytes: a stop string that straddles six tokens
    ("rld", "Hello wo"),
    ("xyz", "Hello world\n\nBye 世界!"),  # never appears: the whole text, finish "length"
])
def test_stop_strings_across_token_boundaries_are_cut_from_the_text(byte_tokenizer, stop, expected):
    model, prompt = scripted(byte_tokenizer, ">", "Hello world\n\nBye 世界!")
    n_bytes = len("Hello world\n\nBye 世界!".encode())
    params = SamplingParams(max_new_tokens=n_bytes, temperature=0, stop=[stop, "never"])
    (c,) = Engine(model, params, byte_tokenizer).generate([prompt])
    assert c.text == expected
    if stop == "xyz":
        assert c.finish_reason == "length" and c.stop is None
    else:
        assert c.finish_reason == "stop" and c.stop == stop
        # the tokens run up to the one that completed the stop string
        assert byte_tokenizer.decode(c.token_ids).endswith(stop)
    assert_same_completions([c], reference_generate(model, [prompt], params, byte_tokenizer))


def test_a_stop_string_can_start_inside_a_token():
    # a BPE with the merge l + o: "Hello world" is H e l "lo" " " w "or"? no: only "lo" and "wo" merge
    tok = BPETokenizer([(ord("l"), ord("o")), (ord("w"), ord("o"))], pattern="gpt2")
    model, prompt = scripted(tok, ">", "Hello world")
    assert len(tok.encode("Hello world")) < len("Hello world")  # the merges are used
    (c,) = Engine(model, SamplingParams(max_new_tokens=20, temperature=0, stop=["o w"]), tok).generate([prompt])
    assert c.text == "Hell" and c.stop == "o w"


def test_the_earliest_stop_string_wins(byte_tokenizer):
    model, prompt = scripted(byte_tokenizer, ">", "abcdef")
    (c,) = Engine(model, SamplingParams(max_new_tokens=10, temperature=0, stop=["def", "bc", "cd"]),
                  byte_tokenizer).generate([prompt])
    assert c.text == "a" and c.stop == "bc"


def test_sampling_never_picks_an_id_the_tokenizer_cannot_decode(byte_tokenizer):
    # a model whose output layer is larger than the vocabulary (padded) and that prefers id 280
    V = 300
    probs = torch.full((V, V), 1.0 / V)
    probs[:, 280] = 0.9
    model = BigramLM(probs / probs.sum(-1, keepdim=True))
    out = Engine(model, SamplingParams(max_new_tokens=50, seed=0, stop_ids=[]), byte_tokenizer).generate([[65]])
    assert max(out[0].token_ids) < byte_tokenizer.vocab_size


# ----- the context window ------------------------------------------------------------------------------------


def test_context_start_by_hand():
    # block 8, keep 4: whole sequence up to 8 tokens; then windows of 4, 5, 6, 7, 8 tokens, then 4 again
    starts = [context_start(n, 8, 4) for n in range(1, 16)]
    assert starts == [0] * 8 + [5, 5, 5, 5, 5, 10, 10]
    assert [context_start(n, 8, 8) for n in (8, 9, 10)] == [0, 1, 2]  # keep = block: slide by one


@pytest.mark.parametrize("positions", POSITIONS)
def test_generation_past_the_context_window_follows_the_policy_with_a_warning(positions):
    model = tiny_gpt(positions=positions, block_size=16)
    params = SamplingParams(max_new_tokens=45, temperature=0)
    prompt = [[1, 2, 3, 4, 5]]
    with pytest.warns(UserWarning, match="context of 16 tokens"):
        cached = Engine(model, params).generate(prompt)
    with pytest.warns(UserWarning, match="context of 16 tokens"):
        naive = reference_generate(model, prompt, params)
    assert len(cached[0].token_ids) == 45
    assert_same_completions(cached, naive)


def test_a_prompt_longer_than_the_window_keeps_its_end():
    model = tiny_gpt(positions="learned", block_size=16)
    prompt = [list(range(40))]
    params = SamplingParams(max_new_tokens=20, temperature=0, window_keep=12)
    with pytest.warns(UserWarning):
        cached = Engine(model, params).generate(prompt)
    with pytest.warns(UserWarning):
        assert_same_completions(cached, reference_generate(model, prompt, params))
    # only the window matters: an unrelated beginning gives the same continuation
    start = context_start(40, 16, 12)
    other = [[90] * start + prompt[0][start:]]
    with pytest.warns(UserWarning):
        assert Engine(model, params).generate(other)[0].token_ids == cached[0].token_ids


def test_a_batch_crossing_the_window_at_different_steps_equals_one_by_one():
    model = tiny_gpt(positions="rope", n_kv_head=1, block_size=16)
    prompts = [[1], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=40, temperature=0, window_keep=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together = Engine(model, params).generate(prompts)
        alone = [Engine(model, params).generate([p])[0] for p in prompts]
        naive = reference_generate(model, prompts, params)
    for c in together:
        c.prompt_index = 0
    assert_same_completions(together, alone)
    for c in naive:
        c.prompt_index = 0
    assert_same_completions(together, naive)


def test_keeping_the_whole_window_is_the_naive_samplers_one_token_slide():
    """`window_keep = block_size` slides by one token per step: greedy over the last 16 tokens, by hand."""
    model = tiny_gpt(positions="learned", block_size=16)
    params = SamplingParams(max_new_tokens=30, temperature=0, window_keep=16)
    with pytest.warns(UserWarning):
        ours = Engine(model, params).generate([[1, 2, 3]])[0].token_ids
    tokens = [1, 2, 3]
    with torch.no_grad():
        for _ in range(30):
            logits, _ = model(torch.tensor([tokens[-16:]]))
            tokens.append(int(logits[0, -1].argmax()))
    assert ours == tokens[3:]


# ----- the public function -------------------------------------------------------------------------------------


def test_generate_takes_text_and_returns_text(byte_tokenizer):
    model, _ = scripted(byte_tokenizer, "Hi", " there", [byte_tokenizer.eos_id])
    out = generate(model, byte_tokenizer, "Hi", SamplingParams(temperature=0, max_new_tokens=10))
    assert [(c.text, c.finish_reason) for c in out] == [(" there", "stop")]


def test_an_empty_prompt_needs_start_ids(byte_tokenizer):
    model = tiny_gpt(vocab_size=byte_tokenizer.vocab_size)
    with pytest.raises(TinyLMError, match="start_ids"):
        generate(model, byte_tokenizer, "", SamplingParams(max_new_tokens=3))
    out = generate(model, byte_tokenizer, "", SamplingParams(max_new_tokens=3, seed=0),
                   start_ids=[byte_tokenizer.eos_id])
    assert len(out[0].token_ids) >= 1


def test_bad_prompts_are_errors():
    model = tiny_gpt()
    with pytest.raises(TinyLMError, match="empty"):
        Engine(model, GREEDY).generate([[]])
    with pytest.raises(TinyLMError, match="vocabulary"):
        Engine(model, GREEDY).generate([[500]])
    with pytest.raises(TinyLMError, match="tokenizer"):
        Engine(model, SamplingParams(stop=["x"]))


def test_the_engine_decodes_in_eval_mode_and_restores_the_mode():
    model = tiny_gpt(dropout=0.5).train()
    params = SamplingParams(max_new_tokens=20, temperature=0)
    a = Engine(model, params).generate([[1, 2, 3]])
    b = Engine(model, params).generate([[1, 2, 3]])
    assert a[0].token_ids == b[0].token_ids  # dropout off while generating
    assert model.training


def test_no_sampler_draws_padding_bos_or_unknown_even_from_a_model_that_prefers_them():
    """A barely trained network gives PAD, BOS and <unk> real mass (here: most of it). The engine, the naive reference
    and beam search never draw them, the same way; EOS stays drawable, and an excluded id asked for as a stop id
    is drawable again."""
    from tinylm.generate.beam import beam_search_completions
    from tinylm.tokenizers import CharTokenizer
    from tinylm.tokenizers.base import generation_excluded

    tok = CharTokenizer.train(["the quick brown fox jumps over the lazy dog"])
    banned = generation_excluded(tok)
    assert {tok.bos_id, tok.pad_id, tok.unk_id} <= set(banned) and tok.eos_id not in banned
    probs = torch.full((tok.vocab_size, tok.vocab_size), 1.0)
    probs[:, banned] = 50.0  # the special ids hold most of the mass after every token
    model = BigramLM(probs / probs.sum(-1, keepdim=True))
    prompt = [[tok.encode("the")[0]]]
    lengths = []
    for params in (SamplingParams(max_new_tokens=60, seed=s, num_samples=4) for s in range(3)):
        drawn = Engine(model, params, tok).generate(prompt)
        assert_same_completions(drawn, reference_generate(model, prompt, params, tok))
        assert all(t not in banned for c in drawn for t in c.token_ids)
        lengths += [len(c.token_ids) for c in drawn]
    # EOS still ends samples, but not at once: one allowed id in about 30, so about 30 tokens a sample
    assert sum(lengths) > 10 * len(lengths)
    greedy = Engine(model, SamplingParams(max_new_tokens=5, temperature=0), tok).generate(prompt)[0]
    assert greedy.token_ids[0] not in banned
    beams = beam_search_completions(model, tok, prompt[0], SamplingParams(max_new_tokens=8, num_beams=3,
                                                                          num_samples=3))
    assert all(t not in banned for c in beams for t in c.token_ids)
    as_stop = Engine(model, SamplingParams(max_new_tokens=50, seed=0, stop_ids=[tok.pad_id]), tok).generate(prompt)
    assert as_stop[0].finish_reason == "stop" and as_stop[0].token_ids[-1] == tok.pad_id


def test_seeded_samples_of_different_prompts_draw_differently_and_each_alone_as_in_a_list():
    """Under a uniform model every token is the random draw alone: two prompts given the same seed must not
    come out with the same tokens (as "To be Lavka" beside "KING. Lavka" did), while a prompt's sample is
    still the same alone and in a list, in the engine, the reference and each order."""
    model = BigramLM(torch.full((64, 64), 1 / 64))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, num_samples=2)
    prompts = [[1, 2, 3], [4]]
    both = Engine(model, params).generate(prompts)
    tokens = [c.token_ids for c in both]
    assert tokens[0] != tokens[2] and tokens[1] != tokens[3]  # prompt 0 and prompt 1, sample by sample
    assert tokens[0] != tokens[1]  # the samples of one prompt differ too
    for i, prompt in enumerate(prompts):
        alone = [c.token_ids for c in Engine(model, params).generate([prompt])]
        assert alone == tokens[2 * i:2 * i + 2]
    assert [c.token_ids for c in reference_generate(model, prompts[::-1], params)] == tokens[2:] + tokens[:2]
