"""Speculative decoding against the engine: the same greedy tokens, the model's own sampling distribution."""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import math
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tinylm.run
from tinylm.errors import TinyLMError
from tinylm.generate.cache import KVCache
from tinylm.cli.generate import cmd_sample
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams, sampling_distribution
from tinylm.generate.speculative import (
    FIRST_PAUSE,
    NGRAM_DRAFT_FILE,
    ROUNDS_PER_CHECK,
    ModelDraft,
    NGramDraft,
    Pacer,
    PromptLookupDraft,
    load_draft,
    ngram_draft,
    speculative_generate,
)
from tinylm.model import NGramLM, NGramModel
from tinylm.tokenizers import BPETokenizer

from toys import ScriptedLM, tiny_gpt

GREEDY = SamplingParams(max_new_tokens=60, temperature=0)
REPETITIVE = [3, 14, 15, 92, 65, 35, 89] * 4


def assert_same(spec, engine) -> None:
    assert spec.token_ids == engine.token_ids
    assert spec.finish_reason == engine.finish_reason
    torch.testing.assert_close(torch.tensor(spec.logprobs), torch.tensor(engine.logprobs), atol=1e-5, rtol=0)


# ----- greedy: token for token the engine's output -------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_match_of_the_longest_tail():
    draft = PromptLookupDraft()
    # tail (7, 8, 9) occurred at 1..3, followed by 4, 5; the shorter tail (9) at 6 is not preferred
    assert draft.propose([1, 7, 8, 9, 4, 5, 9, 0, 7, 8, 9], 2, None, GREEDY, None) == ([4, 5], None)
    assert draft.propose([1, 2, 3], 4, None, GREEDY, None) == ([], None)  # nothing repeats
    assert draft.propose([5, 1, 2, 5], 3, None, GREEDY, None) == ([1, 2, 5], None)  # unigram 5, latest earlier


@pytest.mark.parametrize("options", [{}, {"bigram_hash": 101, "n_kv_head": 2}])
def test_greedy_prompt_lookup_equals_the_engine_and_keeps_drafts_on_a_repetitive_prompt(options):
    model = tiny_gpt(**options)
    if "bigram_hash" in options:
        with torch.no_grad():
            model.bigram.weight.normal_(0, 1.0)  # the cache's last token matters after a rollback
    spec, stats = speculative_generate(model, REPETITIVE, GREEDY, PromptLookupDraft(), k=4, adaptive=False)
    assert_same(spec, Engine(model, GREEDY).generate([REPETITIVE])[0])
    assert stats.tokens == 60 and stats.proposed > stats.accepted  # drafts were rejected and rolled back
    assert stats.forward_passes == 1 + stats.tokens - stats.accepted  # the prefill, then kept + 1 tokens a pass
    if not options:  # this model falls into a loop the lookup predicts
        assert stats.accepted >= 10


def test_greedy_with_a_different_random_draft_model_equals_the_engine_though_most_drafts_are_rejected():
    model, other = tiny_gpt(seed=0), tiny_gpt(seed=1)
    spec, stats = speculative_generate(model, REPETITIVE, GREEDY, ModelDraft.of(other), k=3, adaptive=False)
    assert_same(spec, Engine(model, GREEDY).generate([REPETITIVE])[0])
    assert stats.proposed >= 50 and stats.acceptance_rate < 0.2


def test_the_model_as_its_own_draft_keeps_every_draft():
    model = tiny_gpt()
    spec, stats = speculative_generate(model, REPETITIVE, GREEDY, ModelDraft.of(model), k=4, adaptive=False)
    assert_same(spec, Engine(model, GREEDY).generate([REPETITIVE])[0])
    assert stats.accepted == stats.proposed > 40
    assert stats.forward_passes <= 1 + math.ceil(60 / 5)  # the prefill, then k + 1 tokens a pass


def test_greedy_speculation_past_the_context_window_equals_the_engine():
    model = tiny_gpt(block_size=32)
    params = SamplingParams(max_new_tokens=80, temperature=0, window_keep=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn that the window was cut
        engine = Engine(model, params).generate([REPETITIVE])[0]
        spec, _ = speculative_generate(model, REPETITIVE, params, PromptLookupDraft(), k=5, adaptive=False)
    assert_same(spec, engine)


def test_a_stop_id_among_the_kept_drafts_ends_the_sample_there():
    model = tiny_gpt()
    engine = Engine(model, GREEDY).generate([REPETITIVE])[0]
    stop = engine.token_ids[20]
    params = SamplingParams(max_new_tokens=60, temperature=0, stop_ids=[stop])
    spec, _ = speculative_generate(model, REPETITIVE, params, ModelDraft.of(model), k=4, adaptive=False)
    assert_same(spec, Engine(model, params).generate([REPETITIVE])[0])
    assert spec.finish_reason == "stop" and spec.token_ids[-1] == stop


def test_kv_cache_truncate_keeps_the_first_positions_and_refuses_to_grow():
    cache = KVCache.for_model(tiny_gpt(), batch=1, max_len=16)
    for layer in cache:
        layer.update(torch.ones(1, 4, 5, 8), torch.ones(1, 4, 5, 8))
    cache.truncate(3)
    assert cache.length == 3
    k, _ = cache[0].update(torch.full((1, 4, 1, 8), 2.0), torch.zeros(1, 4, 1, 8))
    assert k.shape[2] == 4 and float(k[0, 0, 3, 0]) == 2.0 and float(k[0, 0, 2, 0]) == 1.0
    with pytest.raises(TinyLMError, match="cannot truncate"):
        cache.truncate(9)


def test_the_pacer_pauses_drafting_that_is_slower_than_plain_steps_and_tries_again():
    pacer = Pacer(k=4)
    for _ in range(3):  # the first plain step is not timed (a compile may happen there)
        assert pacer.drafts() == 0
        pacer.record(0, 0, 0.010)
    pacer.record(4, 4, 9.0)  # the first drafted round is not timed either
    # rounds of 5 drafts keeping 1 (2 tokens) in 30 ms: 67 tokens/s against 100 plain
    for _ in range(ROUNDS_PER_CHECK):
        assert pacer.drafts() >= 1
        pacer.record(pacer.drafts(), 1, 0.030)
    assert pacer.drafts() == 0 and pacer.pause == FIRST_PAUSE
    for _ in range(FIRST_PAUSE):
        assert pacer.drafts() == 0
        pacer.record(0, 0, 0.010)
    assert pacer.drafts() >= 1  # tries again
    for _ in range(ROUNDS_PER_CHECK):  # still slower: a pause twice as long
        pacer.record(pacer.drafts(), 0, 0.030)
    assert pacer.pause == 2 * FIRST_PAUSE
    for _ in range(2 * FIRST_PAUSE):
        pacer.record(0, 0, 0.010)
    for _ in range(ROUNDS_PER_CHECK):  # now drafts pay: 4 tokens in 15 ms, 267 tokens/s
        pacer.record(3, 3, 0.015)
    assert pacer.drafts() >= 1 and pacer.pause == 0 and pacer.next_pause == FIRST_PAUSE


def test_greedy_output_is_the_engines_whatever_the_pacer_decides():
    model = tiny_gpt()
    spec, _ = speculative_generate(model, REPETITIVE, GREEDY, ModelDraft.of(tiny_gpt(seed=3)), k=4)
    assert_same(spec, Engine(model, GREEDY).generate([REPETITIVE])[0])


def test_bad_requests_are_refused_in_one_line():
    model = tiny_gpt()
    with pytest.raises(TinyLMError, match="one sample of one prompt"):
        speculative_generate(model, [1, 2], SamplingParams(num_beams=2, temperature=0), PromptLookupDraft())
    with pytest.raises(TinyLMError, match="k must be"):
        speculative_generate(model, [1, 2], GREEDY, PromptLookupDraft(), k=0)


# ----- sampling: the model's distribution, whatever the draft --------------------------------------


def exact_joint(model, prompt, params, n) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under the model with the request's filters, by enumerating every prefix."""
    V = model.config.vocab_size
    out = {}
    for path in itertools.product(range(V), repeat=n):
        prob = 1.0
        for i in range(n):
            logits, _ = model(torch.tensor([prompt + list(path[:i])]))
            prob *= float(sampling_distribution(logits[:, -1], params)[0, path[i]])
        out[path] = prob
    return out


def disagreeing_ngram() -> NGramDraft:
    """A bigram counted on a made-up stream over ids 0..2 (3 is EOS, 4 BOS): it proposes what the model rarely would."""
    stream = [1, 2, 1, 2, 0, 1, 2, 2, 1, 3, 2, 2, 1, 0, 0, 1, 2, 3]
    return NGramDraft(NGramModel.fit(stream, 2, vocab_size=5, bos_id=4, eos_id=3))


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["model", "lookup", "ngram"])
@torch.inference_mode()
def test_sampled_tokens_follow_the_models_distribution_with_a_disagreeing_draft(draft_kind):
    # vocabulary 4, the first 3 tokens: 64 outcomes, all checked in one round of k = 2 drafts plus the bonus
    model, other = tiny_gpt(seed=0, vocab_size=4), tiny_gpt(seed=5, vocab_size=4)
    prompt = [0, 1, 2, 3, 0, 1]  # the lookup proposes 2, 3 after the tail (0, 1)
    params = SamplingParams(max_new_tokens=3, temperature=0.9, top_k=3)
    p = exact_joint(model, prompt, params, 3)
    draft = {"model": lambda: ModelDraft.of(other), "lookup": PromptLookupDraft, "ngram": disagreeing_ngram}[draft_kind]()
    N = 2000
    counts = dict.fromkeys(p, 0)
    accepted = 0
    for seed in range(N):
        params.seed = seed
        c, stats = speculative_generate(model, prompt, params, draft, k=2, adaptive=False)
        counts[tuple(c.token_ids)] += 1
        accepted += stats.accepted
    tv = 0.5 * sum(abs(counts[x] / N - p[x]) for x in p)
    # The bound: E[TV] <= 1/2 sum_x sqrt(p_x (1 - p_x) / N) (Jensen on each |count/N - p_x|), and TV moves by
    # at most 1/N when one draw changes, so by McDiarmid P(TV > E[TV] + t) <= exp(-2 N t^2) = 1e-6 for
    # t = sqrt(ln(1e6) / (2N)). A correct sampler fails this with probability below one in a million.
    bound = 0.5 * sum(math.sqrt(px * (1 - px) / N) for px in p.values()) + math.sqrt(math.log(1e6) / (2 * N))
    assert tv < bound, (tv, bound)
    assert 0 < accepted < 3 * N  # drafts were both kept and rejected
    if draft_kind == "model":  # the draft alone is far from the model: keeping its tokens unchecked would fail
        q = exact_joint(other, prompt, params, 3)
        assert 0.5 * sum(abs(p[x] - q[x]) for x in p) > 2 * bound


# ----- tinylm sample --draft -----------------------------------------------------------------------


@pytest.fixture
def runs(byte_tokenizer, monkeypatch):
    """`load_run` replaced: runs/x says " to be\\n\\nor not" after "<eos>To be, or not"; runs/draft is a random
    GPT on the same tokenizer; runs/other has another tokenizer."""
    tok = byte_tokenizer
    start = [tok.eos_id]
    script = start + tok.encode("To be, or not") + tok.encode(" to be\n\nor not") + [tok.eos_id]
    found = {"runs/x": SimpleNamespace(model=ScriptedLM(script, tok.vocab_size), tokenizer=tok, start_ids=start),
             "runs/draft": SimpleNamespace(model=tiny_gpt(vocab_size=tok.vocab_size), tokenizer=tok, start_ids=start),
             "runs/other": SimpleNamespace(model=tiny_gpt(), tokenizer=BPETokenizer([], pattern="gpt4"),
                                           start_ids=start)}
    monkeypatch.setattr(tinylm.run, "load_run", lambda path, *a, **k: found[str(path)])
    return found


def sample_args(**changes) -> argparse.Namespace:
    args = dict(run="runs/x", prompt=["To be, or not"], prompt_file=None, num_samples=1, max_new_tokens=50,
                temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None, stop=None, stream=False, num_beams=1,
                draft="prompt", draft_k=4, compile=False)
    args.update(changes)
    return argparse.Namespace(**args)


@pytest.mark.parametrize("draft", ["prompt", "runs/draft"])
def test_sample_with_a_draft_prints_the_models_text_and_the_counters(runs, draft, capsys):
    out = io.StringIO()
    assert cmd_sample(sample_args(draft=draft), out=out) == 0
    assert out.getvalue() == "To be, or not to be\n\nor not\n"  # the model's text, drafted or not
    assert re.fullmatch(r"speculative decoding: \d+ of \d+ drafted tokens kept \(\d+%\), 15 tokens in \d+ model "
                        r"passes\n", capsys.readouterr().err)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_beams": 2}, "not beam search"),
    ({"prompt": ["a", "b"]}, "one sample of one prompt"),
    ({"num_samples": 2, "temperature": 1.0}, "one sample of one prompt"),
    ({"draft": "runs/other"}, "another tokenizer"),
    ({"draft": None, "num_beams": 2, "compile": True}, "--compile .* beam search"),
])
def test_sample_refuses_what_the_draft_does_not_do_in_one_line(runs, changes, message):
    with pytest.raises(TinyLMError, match=message) as e:
        cmd_sample(sample_args(**changes), out=io.StringIO())
    assert "\n" not in str(e.value)


def test_sample_streams_with_a_draft_the_text_it_prints_without_streaming(runs, capsys):
    out = io.StringIO()
    assert cmd_sample(sample_args(stream=True), out=out) == 0
    assert out.getvalue() == "To be, or not to be\n\nor not\n"
    assert "speculative decoding:" in capsys.readouterr().err


# ----- the run's own n-gram draft ------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard_run(tmp_path_factory):
    """A run folder whose run.json points at real prepared shards (a random GPT, a BPE tokenizer on the same text)."""
    from serve.servekit import make_run

    from tinylm.data.corpora import load_corpus
    from tinylm.data.shards import prepare
    from tinylm.run import data_info, write_run_info

    root = tmp_path_factory.mktemp("ngram-draft")
    text = root / "text.txt"
    text.write_text("\n\n".join(f"To be, or not to be: that is question {i}. Whether 'tis nobler in the mind."
                                  for i in range(40)), encoding="utf-8")
    run_dir = make_run(root / "run", block_size=128)
    run = tinylm.run.load_run(run_dir)
    shards = prepare(load_corpus(str(text)), run.tokenizer, root / "shards", workers=1)
    write_run_info(run_dir, {"status": "complete", "data": data_info(shards)})
    return run_dir, shards


def test_the_ngram_draft_is_counted_from_the_runs_shards_once_and_kept_in_the_run_folder(shard_run):
    run_dir, shards = shard_run
    run = tinylm.run.load_run(run_dir)
    lines = []
    counted = ngram_draft(run_dir, run.tokenizer, log=lines.append)
    assert (run_dir / NGRAM_DRAFT_FILE).is_file() and "counted a 3-gram draft" in lines[0]
    again = ngram_draft(run_dir, run.tokenizer, log=lines.append)
    assert len(lines) == 1  # loaded, not counted again
    oracle = NGramModel.fit_shards(shards, 3, smoothing="kn")  # the same counts of the training split
    for context in ([], run.tokenizer.encode("To be, or")[-2:], [5, 9]):
        np.testing.assert_allclose(again.next_token_distribution(context), oracle.next_token_distribution(context))
        np.testing.assert_allclose(counted.next_token_distribution(context), oracle.next_token_distribution(context))


def test_greedy_with_the_ngram_draft_equals_the_engine_on_a_run(shard_run):
    run_dir, _ = shard_run
    run = tinylm.run.load_run(run_dir)
    draft = load_draft("ngram", run)
    ids = run.start_ids + run.tokenizer.encode("To be, or not")
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_ids=[])
    spec, stats = speculative_generate(run.model, ids, params, draft, k=4, tokenizer=run.tokenizer, adaptive=False)
    assert_same(spec, Engine(run.model, params, run.tokenizer).generate([ids])[0])
    assert stats.proposed > 0


def test_the_ngram_draft_without_shards_is_refused_in_one_line(tmp_path):
    from serve.servekit import make_run

    run = tinylm.run.load_run(make_run(tmp_path / "run"))
    with pytest.raises(TinyLMError, match="no n-gram draft .* records no training shards") as e:
        load_draft("ngram", run)
    assert "\n" not in str(e.value)


def test_an_ngram_run_drafts_with_its_counts(shard_run, tmp_path):
    run_dir, shards = shard_run
    run = tinylm.run.load_run(run_dir)
    ngram_run = SimpleNamespace(tokenizer=run.tokenizer,
                                model=NGramLM(NGramModel.fit_shards(shards, 2), dataclasses.replace(run.model.config)))
    original = tinylm.run.load_run
    try:
        tinylm.run.load_run = lambda path, *a, **k: ngram_run
        draft = load_draft("runs/ngram", run)
    finally:
        tinylm.run.load_run = original
    assert isinstance(draft, NGramDraft) and draft.ngram.order == 2


def test_sample_parses_draft_and_draft_k():
    from tinylm.cli import build_parser

    args = build_parser().parse_args(["sample", "--run", "r", "--draft", "prompt", "--draft-k", "6"])
    assert (args.draft, args.draft_k, args.compile) == ("prompt", 6, False)
    args = build_parser().parse_args(["sample", "--run", "r", "--draft", "ngram", "--compile"])
    assert (args.draft, args.compile) == ("ngram", True)
