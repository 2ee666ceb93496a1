"""The server's prefix cache: a request that starts with an earlier request's prompt and reply runs only the rest.

The scheduler counts the prompt tokens it ran through the model and those it copied from the cache; the replies
are compared with the same app serving without a cache (``prefix_cache_mb=0``).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tinylm.cli import main
from tinylm.serve.app import create_app

GREEDY = {"temperature": 0, "max_tokens": 8}


def complete(client: TestClient, prompt) -> str:
    answer = client.post("/v1/completions", json={"prompt": prompt, **GREEDY})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def stats(client: TestClient) -> dict:
    return client.get("/health").json()["scheduler"]


def test_a_second_request_reuses_the_first_ones_prompt_and_reply(run):
    first = run.tokenizer.encode("To be, or not")
    with TestClient(create_app(run)) as cached, TestClient(create_app(run, prefix_cache_mb=0)) as plain:
        replies = [complete(c, first) for c in (cached, plain)]
        assert replies[0] == replies[1]
        second = first + run.tokenizer.encode(replies[0]) + run.tokenizer.encode(" to be")
        before = stats(cached)
        assert before["prefix_cache_entries"] == 1 and before["prefix_cache_bytes"] > 0
        assert complete(cached, second) == complete(plain, second)
        after = stats(cached)
        reused = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
        ran = after["prompt_tokens_run"] - before["prompt_tokens_run"]
        whole = len(run.start_ids) + len(second)
        assert reused >= len(run.start_ids) + len(first)  # at least the first prompt came from the cache
        assert ran + reused == whole and ran < whole
        off = stats(plain)
        assert (off["prompt_tokens_reused"], off["prefix_cache_entries"]) == (0, 0)
        assert off["prompt_tokens_run"] == 2 * len(run.start_ids) + len(first) + len(second)


def test_a_chat_conversation_reuses_its_earlier_turns(run):
    messages = [{"role": "user", "content": "Hi"}]
    short = {"temperature": 0, "max_tokens": 4}  # the whole conversation fits the 64-token context
    with TestClient(create_app(run)) as cached, TestClient(create_app(run, prefix_cache_mb=0)) as plain:
        for turn in range(2):
            answers = [c.post("/v1/chat/completions", json={"messages": messages, **short}).json()
                       for c in (cached, plain)]
            assert answers[0]["usage"]["prompt_tokens"] <= 60
            reply = answers[0]["choices"][0]["message"]["content"]
            assert reply == answers[1]["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {turn}?"}]
        assert stats(cached)["prompt_tokens_reused"] > 0
        assert stats(cached)["prompt_tokens_run"] < stats(plain)["prompt_tokens_run"]


def test_echoed_prompts_and_batches_read_everything(run):
    prompt = run.tokenizer.encode("whether 'tis nobler")
    with TestClient(create_app(run)) as client:
        complete(client, prompt)
        before = stats(client)
        echo = client.post("/v1/completions", json={"prompt": prompt + [5], "echo": True, "logprobs": 1, **GREEDY})
        assert echo.status_code == 200
        assert stats(client)["prompt_tokens_reused"] == before["prompt_tokens_reused"]  # every position's logits


def test_a_negative_budget_is_refused_by_the_command(run_dir, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--run", str(run_dir), "--prefix-cache-mb", "-1"])
    assert exit.value.code == 2 and "--prefix-cache-mb" in capsys.readouterr().err
