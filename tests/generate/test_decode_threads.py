"""The decoding step's thread count and pinning, chosen by timing (`tinylm.generate.threads`).

The timed calls here sleep for a time that depends on the thread count or the cores the process may
run on, so which setting is fastest is known, and far apart enough (10x) for a shared machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import tinylm.device as device
import tinylm.generate.threads as threads
from tinylm.generate.engine import Engine
from tinylm.generate.fast import decode_weights
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.threads import DecodeThreads

from runkit import write_model_run
from toys import tiny_gpt

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="pinning to part of the machine needs two cores")


@pytest.fixture(autouse=True)
def _threads_kept():
    before = torch.get_num_threads()
    yield
    device.pin_threads(None)
    torch.set_num_threads(before)


def sleeps_by_threads(seconds: dict[int, float]):
    calls = []

    def call():
        calls.append(torch.get_num_threads())
        time.sleep(seconds[torch.get_num_threads()])

    return call, calls


def test_counts_halve_while_the_smaller_one_is_faster():
    call, _ = sleeps_by_threads({4: 0.02, 2: 0.002, 1: 0.0002})
    best, measured = threads.fastest(call, 4, None, rounds=3)
    assert best == DecodeThreads(1)
    assert [(a.threads, b.threads) for a, _, b, _ in measured] == [(4, 2), (2, 1)]
    assert all(tb < ta for _, ta, _, tb in measured)


def test_halving_stops_at_the_first_smaller_count_that_loses():
    call, calls = sleeps_by_threads({4: 0.0003, 2: 0.003, 1: 0.0001})  # 1 would win, but 2 lost to 4 first
    best, measured = threads.fastest(call, 4, None, rounds=3)
    assert best == DecodeThreads(4) and [(a.threads, b.threads) for a, _, b, _ in measured] == [(4, 2)]
    assert 1 not in calls


def test_more_threads_are_kept_when_they_are_faster():
    call, _ = sleeps_by_threads({2: 0.0002, 1: 0.003})
    best, _ = threads.fastest(call, 2, None, rounds=3)
    assert best == DecodeThreads(2)


@two_cores
def test_pinning_to_the_least_busy_cores_is_timed_against_not_pinning():
    free = [CORES[1], CORES[0]] + CORES[2:]  # core CORES[1] least busy

    def pinned_is_faster():
        time.sleep(0.0002 if device.pinned_cores() == {CORES[1]} else 0.003)

    best, measured = threads.fastest(pinned_is_faster, 1, free, rounds=3)
    assert best == DecodeThreads(1, (CORES[1],)) and [(a, b) for a, _, b, _ in measured] == [(DecodeThreads(1), best)]

    def unpinned_is_faster():
        time.sleep(0.003 if device.pinned_cores() else 0.0002)

    best, _ = threads.fastest(unpinned_is_faster, 1, free, rounds=3)
    assert best == DecodeThreads(1)
    assert device.pinned_cores() is not None  # the last setting timed stays until someone applies another
    DecodeThreads(1).apply()
    assert device.pinned_cores() is None and set(os.sched_getaffinity(0)) == set(CORES)


def test_a_pin_that_fails_changes_nothing():
    before = os.sched_getaffinity(0)
    assert device.pin_threads({10**6}) is False  # no such core
    assert device.pinned_cores() is None and os.sched_getaffinity(0) == before
    DecodeThreads(1).apply()  # and the next setting applies as usual
    assert device.pinned_cores() is None


@two_cores
def test_a_pin_holds_every_thread_of_the_process_and_is_undone_when_the_command_block_ends():
    started, done = threading.Event(), threading.Event()
    tid = []

    def worker():
        tid.append(threading.get_native_id())
        started.set()
        done.wait(10)

    other = threading.Thread(target=worker)
    other.start()
    started.wait(10)
    try:
        with device.use_threads("cpu", 2):  # (inside the suite's own one-thread block)
            assert device.pin_threads({CORES[0]})
            assert os.sched_getaffinity(tid[0]) == {CORES[0]} == os.sched_getaffinity(0)
            assert device.pinned_cores() == {CORES[0]}
        assert os.sched_getaffinity(tid[0]) == set(CORES) == os.sched_getaffinity(0)
        assert device.pinned_cores() is None
    finally:
        done.set()
        other.join()


GREEDY = SamplingParams(max_new_tokens=12, temperature=0, stop_ids=[])


def test_the_engine_measures_once_says_it_and_reads_the_prompt_with_the_commands_count(monkeypatch):
    model = tiny_gpt()
    with torch.inference_mode():
        expected = Engine(model, GREEDY, vocab_size=model.config.vocab_size).generate([[5, 6, 7]])[0].token_ids
    asked = []

    def one_thread_wins(call, most, free, rounds=threads.ROUNDS):
        call()  # the decoder's own step runs here
        asked.append(most)
        return DecodeThreads(1), [(DecodeThreads(2), 2e-4, DecodeThreads(1), 1e-4)]

    monkeypatch.setattr(threads, "fastest", one_thread_wins)
    counts = []  # (tokens a row, threads) of each pass through the layout
    layout = decode_weights(model)
    hidden = layout.hidden
    monkeypatch.setattr(layout, "hidden", lambda tokens, *rest, **kw: (
        counts.append((tokens.size(1), torch.get_num_threads())), hidden(tokens, *rest, **kw))[-1])
    said = []
    monkeypatch.setattr(device, "_active", [(device.ThreadChoice(2, 2), said.append)])  # a command chose 2
    torch.set_num_threads(2)
    for _ in range(2):
        with torch.inference_mode():
            tokens = Engine(model, GREEDY, vocab_size=model.config.vocab_size).generate([[5, 6, 7]])[0].token_ids
        assert tokens == expected
    assert asked == [2]  # measured once for the model, from the command's count
    assert said == ["decoding with 1 thread, measured fastest (ms a step: 2 threads 0.2 against 1 thread 0.1)"]
    prompts = [n for T, n in counts if T > 1]
    assert len(prompts) == 2 and set(prompts) == {2}  # each prompt read with the command's 2 threads
    assert {n for T, n in counts[counts.index((1, 1)):] if T == 1} == {1}  # the steps after the choice with 1
    assert torch.get_num_threads() == 2  # back to the command's count once the engine is done


def test_a_count_set_by_the_user_is_used_as_it_is(monkeypatch):
    model = tiny_gpt()
    monkeypatch.setattr(threads, "fastest", lambda *a, **k: pytest.fail("measured a count the user set"))
    said = []
    with device.use_threads("cpu", setting=2, log=said.append), torch.inference_mode():
        Engine(model, GREEDY, vocab_size=model.config.vocab_size).generate([[5, 6, 7]])
        assert torch.get_num_threads() == 2
    assert said == []


def test_without_a_command_block_nothing_is_measured(monkeypatch):
    model = tiny_gpt()
    monkeypatch.setattr(threads, "fastest", lambda *a, **k: pytest.fail("measured outside a command"))
    monkeypatch.setattr(device, "_active", [])  # (the suite runs each test inside a one-thread block)
    assert device.active_choice() is None
    with torch.inference_mode():
        Engine(model, GREEDY, vocab_size=model.config.vocab_size).generate([[5, 6, 7]])


@two_cores
def test_tinylm_sample_says_the_measured_setting_unless_threads_is_given(tmp_path, byte_tokenizer):
    run = str(write_model_run(tmp_path / "run", tiny_gpt(vocab_size=byte_tokenizer.vocab_size), byte_tokenizer))
    flags = ["sample", "--run", run, "--prompt", "To be", "--temperature", "0", "--max-new-tokens", "8"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    chosen, given = (subprocess.run([sys.executable, "-m", "tinylm", *flags, *extra], capture_output=True, text=True,
                                    env=env, timeout=120) for extra in ([], ["--threads", "1"]))
    assert chosen.returncode == 0 and given.returncode == 0, chosen.stderr + given.stderr
    said = [line for line in chosen.stderr.splitlines() if "decoding with" in line]
    assert len(said) == 1 and said[0].startswith("tinylm: decoding with ") and "measured fastest" in said[0]
    assert "decoding with" not in given.stderr
    assert chosen.stdout == given.stdout  # the same greedy text whatever the setting



def test_the_setting_is_measured_before_the_first_token_is_given(monkeypatch):
    """So that the line saying it comes before streamed text, not inside it."""
    model = tiny_gpt()
    asked = []

    def two_threads_win(call, most, free, rounds=threads.ROUNDS):
        call()
        asked.append(most)
        return DecodeThreads(2), [(DecodeThreads(2), 1e-4, DecodeThreads(1), 2e-4)]

    monkeypatch.setattr(threads, "fastest", two_threads_win)
    monkeypatch.setattr(device, "_active", [(device.ThreadChoice(2, 2), None)])
    torch.set_num_threads(2)
    with torch.inference_mode():
        events = Engine(model, GREEDY, vocab_size=model.config.vocab_size).events([[5, 6, 7]])
        first = next(events)
        assert asked == [2]
        rest = [event.token for event in events]
    with torch.inference_mode():
        expected = Engine(model, GREEDY, vocab_size=model.config.vocab_size).generate([[5, 6, 7]])[0].token_ids
    assert [first.token, *rest] == expected  # the measuring steps left no trace in the cache
