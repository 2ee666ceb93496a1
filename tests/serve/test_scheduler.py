"""The batching scheduler on its own (no HTTP): per-row settings, batching invariance, fairness, cancelling."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from servekit import ScriptedLM, SlowLM, counted_ngram, wait_for

import tinylm.serve.batch as batch_module
import tinylm.serve.scheduler as scheduler_module
from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.generate import SamplingParams, generate
from tinylm.generate.fast import StaticDecoder
from tinylm.model import RecurrentLM
from tinylm.serve.jobs import ChoiceEvent, Job, JobDone, JobFailed
from tinylm.serve.scheduler import Scheduler

PROMPTS = ["To be", "Naïve café owners", "東京", "", "whether 'tis nobler in the mind to suffer the slings"]


class Recorder:
    """Collects one job's events; ``order`` (shared by the jobs of a test) records when each job finished."""

    def __init__(self, name: str = "", order: list | None = None) -> None:
        self.name, self.order = name, order if order is not None else []
        self.texts: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.failed: str | None = None
        self.done = threading.Event()

    def __call__(self, events: list) -> None:
        for e in events:
            if isinstance(e, ChoiceEvent):
                self.texts[e.index] = self.texts.get(e.index, "") + e.text
                if e.finish_reason:
                    self.finish[e.index] = e.finish_reason
            elif isinstance(e, JobFailed):
                self.failed = e.message
                self.done.set()
            elif isinstance(e, JobDone):
                self.order.append(self.name)
                self.done.set()

    def result(self) -> list[tuple[str, str]]:
        assert self.done.wait(30), "the job never finished"
        return [(self.texts.get(i, ""), self.finish[i]) for i in sorted(self.finish)]


def settings(i: int) -> SamplingParams:
    """Different settings for every job: greedy and sampled, filters on and off, n of 1 or 2, stop strings."""
    return SamplingParams(max_new_tokens=8 + 5 * i, temperature=[0.0, 0.8, 1.2][i % 3], top_k=[None, 30][i % 2],
                          top_p=[None, 0.9, None][i % 3], min_p=[None, None, 0.05][i % 3], seed=10 + i,
                          num_samples=1 + i % 2, stop=("e ",) if i == 3 else ())


def run_jobs(run, max_batch_size: int, start_first: bool = True):
    scheduler = Scheduler(run.model, run.tokenizer, max_batch_size=max_batch_size)
    if start_first:
        scheduler.start()
    recorders = []
    for i, prompt in enumerate(PROMPTS):
        recorders.append(Recorder())
        ids = run.start_ids + run.tokenizer.encode(prompt)
        scheduler.submit(Job([ids], settings(i), on_event=recorders[-1]))
    scheduler.start()
    try:
        return [r.result() for r in recorders], scheduler.stats()
    finally:
        scheduler.close()


def test_rows_with_their_own_settings_give_the_library_s_samples_however_they_are_batched(run):
    together, stats = run_jobs(run, max_batch_size=32, start_first=False)  # all five jobs in one batch
    assert stats["largest_batch"] == sum(p.num_samples for p in map(settings, range(5)))
    alone, stats = run_jobs(run, max_batch_size=1)  # one row at a time
    assert stats["largest_batch"] == 1
    assert together == alone
    for i, prompt in enumerate(PROMPTS):
        expected = generate(run.model, run.tokenizer, prompt, settings(i), start_ids=run.start_ids)
        assert together[i] == [(c.text, c.finish_reason) for c in expected]


def test_a_short_request_joins_a_running_batch_and_finishes_first(run):
    order: list[str] = []
    slow = SlowLM(run.model, 0.005)
    scheduler = Scheduler(slow, run.tokenizer, max_batch_size=8).start()
    try:
        long, short = Recorder("long", order), Recorder("short", order)
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=40, temperature=0), on_event=long))
        assert wait_for(lambda: scheduler.stats()["steps"] >= 5, timeout=30, poll=0.001)  # the long job is running
        scheduler.submit(Job([run.start_ids + [70]], SamplingParams(max_new_tokens=3, temperature=0), on_event=short))
        assert long.result() and short.result()
        assert order == ["short", "long"] and scheduler.stats()["largest_batch"] == 2
        [expected] = generate(run.model, run.tokenizer, "", SamplingParams(max_new_tokens=40, temperature=0),
                              start_ids=run.start_ids)
        assert long.result() == [(expected.text, expected.finish_reason)]  # joining changed nothing it computed
    finally:
        scheduler.close()


def test_admission_takes_one_row_per_waiting_request_in_turn(run):
    """With two slots, a request for 4 samples does not make the 1-sample request behind it wait for all 4."""
    order: list[str] = []
    scheduler = Scheduler(run.model, run.tokenizer, max_batch_size=2)
    many, one = Recorder("many", order), Recorder("one", order)
    scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=6, seed=1, num_samples=4), on_event=many))
    scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=6, seed=2), on_event=one))
    scheduler.start()
    try:
        assert len(many.result()) == 4 and len(one.result()) == 1
        assert order == ["one", "many"]  # first-come-first-served by row would admit many's rows 0 and 1 first
    finally:
        scheduler.close()


def test_cancelling_a_running_job_frees_its_slot(run):
    scheduler = Scheduler(SlowLM(run.model, 0.01), run.tokenizer, max_batch_size=1).start()
    try:
        first, second = Recorder(), Recorder()
        job = Job([run.start_ids], SamplingParams(max_new_tokens=50, temperature=0), on_event=first)
        scheduler.submit(job)
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=4, temperature=0), on_event=second))
        assert wait_for(lambda: scheduler.stats()["steps"] >= 3, timeout=30, poll=0.001)
        scheduler.cancel(job)
        assert len(second.result()) == 1  # admitted once the only slot was freed
        assert not first.done.is_set() and scheduler.stats()["cancelled_rows"] == 1
    finally:
        scheduler.close()


def test_a_failing_model_fails_its_jobs_and_the_scheduler_keeps_serving(run):
    class Flaky(torch.nn.Module):
        """Raises on any batch holding token 13 (a stand-in for an out-of-memory in the middle of serving)."""

        def __init__(self):
            super().__init__()
            self.inner, self.config = run.model, run.model.config

        def forward(self, idx, *args, **kwargs):
            if (idx == 13).any():
                raise RuntimeError("device out of memory")
            return self.inner(idx, *args, **kwargs)

    scheduler = Scheduler(Flaky(), run.tokenizer).start()
    try:
        bad, good = Recorder(), Recorder()
        scheduler.submit(Job([run.start_ids + [13]], SamplingParams(max_new_tokens=5), on_event=bad))
        assert bad.done.wait(10) and "device out of memory" in bad.failed
        scheduler.submit(Job([run.start_ids + [14]], SamplingParams(max_new_tokens=5, temperature=0), on_event=good))
        assert len(good.result()) == 1
    finally:
        scheduler.close()


def test_submit_refuses_what_cannot_fit_the_context(run):
    scheduler = Scheduler(run.model, run.tokenizer)
    with pytest.raises(TinyLMError, match="exceeds the model's context of 64"):
        scheduler.submit(Job([[1] * 60], SamplingParams(max_new_tokens=5), on_event=print))
    with pytest.raises(TinyLMError, match="outside the vocabulary"):
        scheduler.submit(Job([[10**6]], SamplingParams(max_new_tokens=5), on_event=print))
    with pytest.raises(TinyLMError, match="max_batch_size"):
        Scheduler(run.model, run.tokenizer, max_batch_size=0)


def test_prefilling_in_several_groups_changes_nothing(run, monkeypatch):
    """With a budget of one logit, every new row is prefilled alone, then merged into the batch."""
    together, _ = run_jobs(run, max_batch_size=32, start_first=False)
    monkeypatch.setattr(batch_module, "PREFILL_LOGITS", 1)
    split, stats = run_jobs(run, max_batch_size=32, start_first=False)
    assert split == together and stats["largest_batch"] == 7


def test_recurrent_and_ngram_models_are_batched_statically_with_the_library_s_results(run):
    """An LSTM's state and an n-gram's history cannot be re-aligned: their rows run in static batches."""
    tok = run.tokenizer
    lstm = RecurrentLM(GPTConfig(family="lstm", vocab_size=tok.vocab_size, block_size=64, n_layer=1, d_model=32,
                                 n_head=1, init_std=0.5)).eval()
    for model in (lstm, counted_ngram(tok)):
        family = type("FamilyRun", (), {"model": model, "tokenizer": tok, "start_ids": run.start_ids})
        results = {}
        for max_batch_size in (32, 2):
            scheduler = Scheduler(model, tok, max_batch_size=max_batch_size)
            assert not scheduler.continuous
            recorders = [Recorder() for _ in PROMPTS]
            for i, prompt in enumerate(PROMPTS):
                scheduler.submit(Job([run.start_ids + tok.encode(prompt)], settings(i), on_event=recorders[i]))
            scheduler.start()
            try:
                results[max_batch_size] = [r.result() for r in recorders]
            finally:
                scheduler.close()
        assert results[32] == results[2]
        for i, prompt in enumerate(PROMPTS):
            expected = generate(family.model, tok, prompt, settings(i), start_ids=run.start_ids)
            assert results[32][i] == [(c.text, c.finish_reason) for c in expected], type(model).__name__


def test_a_cancel_landing_in_the_middle_of_a_merge_fails_no_one(run, monkeypatch):
    """The HTTP thread cancels a job while `_merge` is building the new cache (after it sized it): the merge must
    keep the rows it sized the cache for, and the other job's three rows finish as the library's samples."""
    ids = run.start_ids + run.tokenizer.encode("To be")
    params = SamplingParams(max_new_tokens=12, seed=1, num_samples=3)
    expected = [(c.text, c.finish_reason) for c in
                generate(run.model, run.tokenizer, "To be", params, start_ids=run.start_ids)]
    scheduler = Scheduler(run.model, run.tokenizer)
    stay, leave = Recorder(), Recorder()
    leaving = Job([ids], SamplingParams(max_new_tokens=12, seed=2), on_event=leave)
    merged = StaticDecoder.merged.__func__

    def sized_then_cancelled(cls, *args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_merge" and not leaving.cancelled:  # after `_merge` sized it
            scheduler.cancel(leaving)  # as a client's disconnect would, at the worst moment
        return merged(cls, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "merged", classmethod(sized_then_cancelled))
    scheduler.submit(Job([ids], params, on_event=stay))
    scheduler.submit(leaving)
    scheduler.start()  # both jobs are admitted together: the first merge sizes a cache for four rows
    try:
        assert stay.done.wait(30) and stay.failed is None, stay.failed
        assert stay.result() == expected
        assert leave.failed is None and not leave.texts and scheduler.stats()["cancelled_rows"] == 1
    finally:
        scheduler.close()


def test_a_job_whose_sampling_fails_fails_alone(run, monkeypatch):
    """A request whose settings break sampling (here: the second draw with top_p 0.5) gets its error; the rows
    decoded in the same steps with other settings finish as the library's, greedy or seeded."""
    real_sample, draws = scheduler_module.sample, []

    def breaks_on_top_p_half(logits, params, generators=None):
        if params.top_p == 0.5:
            draws.append(1)
            if len(draws) >= 2:  # the prefill's draw goes through; the first decoding step's does not
                raise IndexError("index -1 is out of bounds for dimension 1 with size 0")
        return real_sample(logits, params, generators)

    monkeypatch.setattr(scheduler_module, "sample", breaks_on_top_p_half)
    good = [SamplingParams(max_new_tokens=10, temperature=0), SamplingParams(max_new_tokens=10, seed=4, top_k=20)]
    scheduler = Scheduler(run.model, run.tokenizer)
    recorders = [Recorder() for _ in range(3)]
    scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=10, top_p=0.5, seed=3, num_samples=2),
                         on_event=recorders[0]))
    for params, recorder in zip(good, recorders[1:]):
        scheduler.submit(Job([run.start_ids], params, on_event=recorder))
    scheduler.start()
    try:
        assert recorders[0].done.wait(10) and "IndexError" in recorders[0].failed
        for params, recorder in zip(good, recorders[1:]):
            expected = generate(run.model, run.tokenizer, "", params, start_ids=run.start_ids)
            assert recorder.done.wait(30) and recorder.failed is None, recorder.failed
            assert recorder.result() == [(c.text, c.finish_reason) for c in expected]
        assert scheduler.stats()["active_rows"] == 0 and scheduler.stats()["largest_batch"] >= 3
    finally:
        scheduler.close()


def test_generators_are_made_on_the_model_s_device(run, monkeypatch):
    """Sampling draws where the probabilities are: a CPU generator cannot draw from CUDA tensors (every sampled
    request would fail on a GPU). No GPU here: the device the generators are asked for is checked instead."""
    real, devices = scheduler_module.prompt_generators, []

    def recording(seed, n_prompts, n_samples, device=None, prompts=None):
        devices.append(device)
        return real(seed, n_prompts, n_samples, "cpu" if device is None else device, prompts=prompts)

    monkeypatch.setattr(scheduler_module, "prompt_generators", recording)
    scheduler = Scheduler(run.model, run.tokenizer).start()
    try:
        sampled, greedy = Recorder(), Recorder()
        params = SamplingParams(max_new_tokens=3, seed=1, num_samples=2)
        scheduler.submit(Job([run.start_ids], params, on_event=sampled))
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=3, temperature=0), on_event=greedy))
        assert len(sampled.result()) == 2 and len(greedy.result()) == 1
    finally:
        scheduler.close()
    assert devices == [next(run.model.parameters()).device]  # once, for the sampled job; greedy needs none


def test_static_batches_keep_their_prefill_logits_under_the_bound(run, monkeypatch):
    """An LSTM's rows are prefilled together in one static batch: admission stops before their logits
    (rows x longest prompt x V) would pass `PREFILL_LOGITS`, and the results are still the library's."""
    tok = run.tokenizer
    lstm = RecurrentLM(GPTConfig(family="lstm", vocab_size=tok.vocab_size, block_size=64, n_layer=1, d_model=32,
                                 n_head=1, init_std=0.5)).eval()
    prompts = [run.start_ids + tok.encode(p) for p in PROMPTS]
    bound = 2 * max(map(len, prompts)) * lstm.config.vocab_size  # room for two rows of the longest prompt
    monkeypatch.setattr(batch_module, "PREFILL_LOGITS", bound)
    sizes, forward = [], lstm.forward

    def measured(*args, **kwargs):
        logits, loss = forward(*args, **kwargs)
        sizes.append(logits.numel())
        return logits, loss

    monkeypatch.setattr(lstm, "forward", measured)
    scheduler = Scheduler(lstm, tok, max_batch_size=32)
    recorders = [Recorder() for _ in PROMPTS]
    for i, ids in enumerate(prompts):
        scheduler.submit(Job([ids], settings(i), on_event=recorders[i]))
    scheduler.start()
    try:
        results = [r.result() for r in recorders]
    finally:
        scheduler.close()
    assert max(sizes) <= bound and 1 < scheduler.stats()["largest_batch"] < 7  # 7 rows in all
    for i, prompt in enumerate(PROMPTS):
        expected = generate(lstm, tok, prompt, settings(i), start_ids=run.start_ids)
        assert results[i] == [(c.text, c.finish_reason) for c in expected]


class TokenRecorder(Recorder):
    """Also keeps the tokens each choice's events list, and the count of tokens generated."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []
        self.generated = 0

    def __call__(self, events: list) -> None:
        for e in events:
            if isinstance(e, ChoiceEvent):
                self.tokens += [t.id for t in e.tokens]
                self.generated += e.generated
        super().__call__(events)


@pytest.mark.parametrize("says, stop, text, listed, generated", [
    # the tokens of "To be, or not": T, o, " be", ",", " o", r, " no", t
    ("To be, or not", "e, o", "To b", 3, 5),  # " be" straddles the cut: listed whole; "," and " o" only make the stop
    ("To be, or not", ", o", "To be", 3, 5),  # the cut falls between two tokens
    ("To be, or not", "To", "", 0, 2),
    ("To be, or not", "zzz", "To be, or not", 8, 9),  # no stop string: every token but the end of text
    # N, "a" + the first byte of ï, its second byte, v, e: the token completing ï begins at the cut
    ("Naïve", "ïve", "Na", 2, 5),
    ("Naïve", "ve", "Naï", 3, 5),  # the token that completes ï is listed with it
])
def test_the_tokens_listed_are_the_ones_whose_text_is_returned(run, says, stop, text, listed, generated):
    tok = run.tokenizer
    script = tok.encode(says)
    assert len(script) == {"To be, or not": 8, "Naïve": 5}[says]  # the splits the comments above describe
    model = ScriptedLM(script + [tok.eos_id], tok.vocab_size, prompt_len=len(run.start_ids))
    scheduler = Scheduler(model, tok).start()
    try:
        recorder = TokenRecorder()
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=20, temperature=0, stop=(stop,)),
                             on_event=recorder))
        assert recorder.result() == [(text, "stop")]
    finally:
        scheduler.close()
    assert recorder.tokens == script[:listed] and recorder.generated == generated


def test_end_all_fails_running_and_waiting_jobs_with_503_and_refuses_new_ones(run):
    scheduler = Scheduler(SlowLM(run.model, 0.01), run.tokenizer, max_batch_size=1).start()
    try:
        running, waiting = Recorder(), Recorder()
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=50, temperature=0), on_event=running))
        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=50, temperature=0), on_event=waiting))
        assert wait_for(lambda: scheduler.stats()["steps"] >= 2, timeout=30, poll=0.001)
        scheduler.end_all()
        for recorder in (running, waiting):
            assert recorder.done.wait(5) and recorder.failed == "the server is shutting down"
        with pytest.raises(TinyLMError, match="shutting down"):
            scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=5), on_event=print))
        assert scheduler.stats()["active_rows"] == scheduler.stats()["waiting_rows"] == 0
    finally:
        scheduler.close()


def test_the_server_draws_no_padding_or_bos_as_the_library_does(run):
    """A model that prefers the special ids (a barely trained one does, a little): the scheduler leaves them out,
    as `generate` does, with the same tokens for the same seed."""
    from tinylm.tokenizers.base import generation_excluded

    tok = run.tokenizer
    banned = generation_excluded(tok)

    class PrefersSpecials(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, *args, **kwargs):
            logits, rest = self.inner(*args, **kwargs)
            logits = logits.clone()
            logits[..., banned] += 8.0
            return logits, rest

    model = PrefersSpecials(run.model)
    params = SamplingParams(max_new_tokens=20, seed=3, num_samples=3)
    alternatives: list = []
    scheduler = Scheduler(model, tok, max_batch_size=8).start()
    try:
        recorder = Recorder()
        scheduler.submit(Job([run.start_ids], params, on_event=recorder))
        served = recorder.result()
        listed = Recorder()

        def keep(events):
            alternatives.extend(t for e in events if isinstance(e, ChoiceEvent) for tok_ in e.tokens for t in tok_.top)
            listed(events)

        scheduler.submit(Job([run.start_ids], SamplingParams(max_new_tokens=5, seed=1), on_event=keep, logprobs=8))
        listed.result()
    finally:
        scheduler.close()
    assert len(alternatives) >= 5 * 8 - 8 and not {t for t, _ in alternatives} & set(banned)  # no -inf alternatives
    library = generate(model, tok, "", params, start_ids=run.start_ids)
    assert served == [(c.text, c.finish_reason) for c in library]
    assert all(t not in banned for c in library for t in c.token_ids)
    assert all("<|" not in text for text, _ in served)


def test_a_bigram_hash_model_keeps_each_rows_last_token_through_merges(run):
    # the bigram table needs the token before each new one; a row joining a running batch brings its own
    import dataclasses
    from types import SimpleNamespace

    from tinylm.model import GPT

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(run.model.config, bigram_hash=97, init_std=0.1)).eval()
    with torch.no_grad():
        model.bigram.weight.normal_(0, 1.0)  # a table that matters (it starts at zero)
    bigram_run = SimpleNamespace(model=model, tokenizer=run.tokenizer, start_ids=run.start_ids)
    together, _ = run_jobs(bigram_run, max_batch_size=32, start_first=False)
    alone, _ = run_jobs(bigram_run, max_batch_size=1)
    assert together == alone
    for i, prompt in enumerate(PROMPTS):
        expected = generate(model, run.tokenizer, prompt, settings(i), start_ids=run.start_ids)
        assert together[i] == [(c.text, c.finish_reason) for c in expected]


# ----- speculative decoding of a lone request --------------------------------------------------------


def test_a_lone_greedy_request_decoded_with_a_draft_gets_the_engines_text_and_keeps_drafts(run):
    from tinylm.generate.speculative import PromptLookupDraft

    prompt = "To be, or not to be, to be, or not"
    params = SamplingParams(max_new_tokens=40, temperature=0, stop_ids=[])
    expected = generate(run.model, run.tokenizer, prompt, params, start_ids=run.start_ids)[0].text
    scheduler = Scheduler(run.model, run.tokenizer, draft=PromptLookupDraft(), draft_k=4).start()
    try:
        recorder = Recorder()
        scheduler.submit(Job([run.start_ids + run.tokenizer.encode(prompt)], params, on_event=recorder))
        assert recorder.result() == [(expected, "length")]
        stats = scheduler.stats()
    finally:
        scheduler.close()
    assert stats["drafted"] > 0 and stats["kept"] > 0  # rounds ran, and some drafts were kept
    assert stats["steps"] < 40  # fewer model passes than tokens


def test_requests_batched_together_with_a_draft_still_get_their_library_samples(run):
    from tinylm.generate.speculative import PromptLookupDraft

    scheduler = Scheduler(run.model, run.tokenizer, draft=PromptLookupDraft())
    recorders = []
    for i, prompt in enumerate(PROMPTS[:3]):
        recorders.append(Recorder())
        scheduler.submit(Job([run.start_ids + run.tokenizer.encode(prompt)], settings(i), on_event=recorders[-1]))
    scheduler.start()
    try:
        for i, (prompt, recorder) in enumerate(zip(PROMPTS[:3], recorders)):
            params = settings(i)
            if params.greedy:  # greedy text is the engine's whether a round drafted or not
                expected = [(c.text, c.finish_reason)
                            for c in generate(run.model, run.tokenizer, prompt, params, start_ids=run.start_ids)]
                assert recorder.result() == expected
            else:
                assert len(recorder.result()) == params.num_samples
    finally:
        scheduler.close()


def test_a_draft_for_a_model_without_a_kv_cache_is_refused_in_one_line(run):
    from tinylm.generate.speculative import PromptLookupDraft

    with pytest.raises(TinyLMError, match="serve it without --draft"):
        Scheduler(counted_ngram(run.tokenizer), run.tokenizer, draft=PromptLookupDraft())
