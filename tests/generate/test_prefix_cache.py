"""The prefix cache: reusing an earlier sequence's keys and values gives what recomputing gives, and runs less.

Every comparison is with the same engine without the cache (greedy tokens equal, logprobs and logits within
float tolerance); the tokens the model ran are counted by a hook on the token embedding, which both decoding
layouts call once per token they read, so a test sees that the reuse happened rather than timing it.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch
from toys import tiny_config, tiny_gpt

import tinylm.generate.fast as fast
from runkit import write_model_run
from tinylm.cli import main
from tinylm.errors import TinyLMError
from tinylm.generate.chat import ChatSession
from tinylm.generate.engine import Engine
from tinylm.generate.fast import StaticDecoder, make_decoder
from tinylm.generate.prefix_cache import PrefixCache, common_prefix, load_prefix, read_rest
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.steps import CachedDecoder
from tinylm.model import GPT
from tinylm.tokenizers import BPETokenizer

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, stop_ids=[])


@pytest.fixture(params=["fast", "model forward"])
def layout(request, monkeypatch):
    """Both decoders: the GPT's `StaticDecoder`, and the model's own forward over a `KVCache` (`CachedDecoder`)."""
    if request.param == "model forward":
        monkeypatch.setattr(fast, "supports", lambda model: False)
    return request.param


class Counted:
    """Counts the tokens ``model`` embeds (a forward hook on its token embedding)."""

    def __init__(self, model: GPT) -> None:
        self.tokens = 0
        model.E.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        self.tokens += inputs[0].numel()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(model, ids, cache=None, params=GREEDY, **options):
    engine = Engine(model, params, prefix_cache=cache, **options)
    return engine.generate([ids])[0], engine


def resumed_equals_recomputed(model, counted: Counted, ids: list[int], cache: PrefixCache):
    """Generate from ``ids`` through ``cache`` and afresh, check both give the same tokens and log-probabilities;
    the engine that used the cache, the one that did not, and the positions the cached run fed the model."""
    before = counted.tokens
    again, engine = generate(model, ids, cache)
    ran = counted.tokens - before
    fresh, plain = generate(model, ids)
    assert again.token_ids == fresh.token_ids
    assert again.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)
    return engine, plain, ran


def test_a_second_turn_reuses_the_first_and_equals_recomputation(layout):
    model = tiny_gpt()
    counted = Counted(model)
    cache = PrefixCache(None)
    first = prompt(20, 1)
    one, _ = generate(model, first, cache)
    assert len(cache) == 1
    second = first + one.token_ids + prompt(7, 2)  # the history, then a new message
    engine, plain, ran = resumed_equals_recomputed(model, counted, second, cache)
    # the first turn's cache held its prompt and every reply token but the last (never fed)
    reused = len(first) + len(one.token_ids) - 1
    assert engine.prompt_tokens_run == len(second) - reused and plain.prompt_tokens_run == len(second)
    assert ran == len(second) - reused + GREEDY.max_new_tokens - 1  # the rest, then one token per step
    assert cache.reused == reused


def test_the_logits_after_a_reused_prefix_are_the_recomputed_ones(layout):
    model = tiny_gpt(1)
    ids = prompt(30, 3)
    cache = PrefixCache(None)
    whole = make_decoder(model, 1, 40)
    with torch.inference_mode():
        expected = whole.start(torch.tensor([ids]), torch.ones(1, 30, dtype=torch.bool), every=True)[0]  # (T, V)
        first = make_decoder(model, 1, 40)
        first.start(torch.tensor([ids[:18]]), torch.ones(1, 18, dtype=torch.bool))
        cache.remember(first, 0, ids[:18])
        entry, n = cache.lookup(ids)
        assert n == 18
        part = make_decoder(model, 1, 40)
        assert isinstance(part, StaticDecoder if layout == "fast" else CachedDecoder)
        load_prefix(part, entry, n)
        last = read_rest(part, ids[n:])  # (1, V)
        steps = part.extend(torch.tensor([prompt(3, 4)]))  # and the steps after it see the same cache
        whole.truncate(30)
        expected_steps = whole.extend(torch.tensor([prompt(3, 4)]))
    torch.testing.assert_close(last[0], expected[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps, expected_steps, atol=1e-4, rtol=1e-4)


def test_a_prompt_that_diverges_midway_reuses_only_the_common_prefix(layout):
    model = tiny_gpt(2)
    counted = Counted(model)
    cache = PrefixCache(None)
    first = prompt(24, 5)
    generate(model, first, cache)
    diverging = first[:10] + [(t + 1) % 97 for t in first[10:16]] + prompt(5, 6)
    engine, _, ran = resumed_equals_recomputed(model, counted, diverging, cache)
    assert engine.prompt_tokens_run == len(diverging) - 10
    assert ran == len(diverging) - 10 + GREEDY.max_new_tokens - 1
    assert len(cache) == 2  # the first sequence still serves prompts that follow it further


def test_a_prompt_already_cached_whole_still_runs_its_last_token():
    model = tiny_gpt(3)
    cache = PrefixCache(None)
    ids = prompt(16, 7)
    generate(model, ids, cache)
    again, engine = generate(model, ids, cache)
    assert engine.prompt_tokens_run == 1 and again.token_ids == generate(model, ids)[0].token_ids


def entry_tensors(n: int, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values for ``n`` positions: (1 layer, 1 head, n, width) each, 8 n width bytes together."""
    return torch.zeros(1, 1, n, width), torch.zeros(1, 1, n, width)


def test_the_least_recently_used_entries_go_when_the_budget_is_spent():
    size = 8 * 10 * 4  # one 10-token entry
    cache = PrefixCache(budget_bytes=2 * size)
    a, b, c = [prompt(10, s) for s in (10, 11, 12)]
    cache.store(a, *entry_tensors(10))
    cache.store(b, *entry_tensors(10))
    assert cache.nbytes == 2 * size
    assert cache.lookup(a + [1])[1] == 10  # a is now the most recently used
    cache.store(c, *entry_tensors(10))
    assert (cache.lookup(b + [1])[0], cache.evicted, cache.nbytes) == (None, 1, 2 * size)
    assert cache.lookup(a + [1])[1] == 10 and cache.lookup(c + [1])[1] == 10
    cache.store(prompt(30, 13), *entry_tensors(30))  # more than the whole budget: not kept
    assert len(cache) == 2


def test_a_longer_sequence_replaces_the_entry_it_extends_and_namespaces_stay_apart():
    cache = PrefixCache(None)
    ids = prompt(12, 14)
    cache.store(ids[:8], *entry_tensors(8))
    cache.store(ids, *entry_tensors(12))
    assert [e.ids for e in cache.entries.values()] == [tuple(ids)]
    cache.store(ids[:5], *entry_tensors(5))  # already served by the longer one
    assert len(cache) == 1
    assert cache.lookup(ids, namespace=1) == (None, 0)
    assert cache.lookup(ids)[1] == 11  # at most all but the last token


def test_bounds_that_cannot_be_meant_are_refused():
    with pytest.raises(TinyLMError, match="--prefix-cache-mb"):
        PrefixCache.megabytes(-1)
    assert PrefixCache.megabytes(0) is None and PrefixCache.megabytes(1).budget == 2**20
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_a_batch_of_prompts_reads_everything_and_stays_correct():
    model = tiny_gpt(4)
    cache = PrefixCache(None)
    first = prompt(12, 15)
    generate(model, first, cache)
    prompts = [first + [3, 4], prompt(9, 16)]
    engine = Engine(model, GREEDY, prefix_cache=cache)
    out = engine.generate(prompts)
    assert engine.prompt_tokens_run == 14 + 9 and len(cache) == 1  # nothing reused, nothing stored
    assert [c.token_ids for c in out] == [c.token_ids for c in Engine(model, GREEDY).generate(prompts)]


def test_windows_that_slide_stay_correct():
    """A prompt longer than the context and a generation that outgrows it: the cache holds the window read."""
    model = tiny_gpt(5, block_size=32)
    cache = PrefixCache(None)
    params = SamplingParams(temperature=0, max_new_tokens=30, stop_ids=[])
    long = prompt(40, 17)
    for _ in range(2):  # the second time, the window the first one read is in the cache
        with pytest.warns(UserWarning):
            out, _ = generate(model, long, cache, params=params)
        with pytest.warns(UserWarning):
            fresh, _ = generate(model, long, params=params)
        assert out.token_ids == fresh.token_ids


def test_a_chat_turn_runs_only_what_follows_the_previous_one(layout):
    tok = BPETokenizer([], pattern="gpt2")
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=tok.vocab_size, block_size=256)).eval()
    sessions = {cached: ChatSession(model, tok, [tok.eos_id], system="Be brief.", prefix_cache=cached,
                                    params=SamplingParams(temperature=0, max_new_tokens=12)) for cached in (True, False)}
    previous = []
    for message in ("Hello there", "What is a cache?", "Thanks"):
        replies = {cached: "".join(s.reply(message)) for cached, s in sessions.items()}
        assert replies[True] == replies[False]
        with_cache, without = sessions[True], sessions[False]
        assert with_cache.last_prompt == without.last_prompt
        assert without.prompt_tokens_run == len(without.last_prompt)
        if previous:  # the previous prompt begins this one: at least that much came from the cache
            assert with_cache.last_prompt[:len(previous)] == previous
            assert with_cache.prompt_tokens_run <= len(with_cache.last_prompt) - len(previous)
        previous = with_cache.last_prompt


def test_the_chat_commands_second_turn_reuses_the_first(tmp_path, monkeypatch, capsys):
    tok = BPETokenizer([], pattern="gpt2")
    torch.manual_seed(1)
    run_dir = write_model_run(tmp_path / "run", GPT(tiny_config(vocab_size=tok.vocab_size, block_size=256)).eval(), tok)
    reused: list[int] = []
    resume = PrefixCache.resume

    def counted_resume(self, decoder, ids, namespace=0):
        logits, n = resume(self, decoder, ids, namespace)
        reused.append(n)
        return logits, n

    monkeypatch.setattr(PrefixCache, "resume", counted_resume)
    outputs = {}
    for flags in ((), ("--no-prefix-cache",)):
        reused.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nHow are you?\n"))
        assert main(["chat", "--run", str(run_dir), "--temperature", "0", "--max-new-tokens", "10", *flags]) == 0
        outputs[flags] = (capsys.readouterr().out, list(reused))
    text, counts = outputs[()]
    assert len(counts) == 2 and counts[0] == 0 and counts[1] > len("Hi")  # the second turn reused the first
    assert outputs[("--no-prefix-cache",)] == (text, [])
    assert len(text.splitlines()) == 2
