"""The two rules every command shares: how many CPU threads it runs on, and how it reads a prompt longer than the
model's context.

- threads (`tinylm.device.use_threads`): one per core not busy now, the busy cores named in one line;
  ``--threads N`` overrides. The busy-core probe is replaced by chosen per-core loads, so the tests say which
  cores are busy whatever the machine is doing.
- long prompts (`tinylm.generate.steps.fit_prompt`): the last block_size tokens are read (the server's, beside
  max_tokens), with one warning line of one wording, in sample, next-token, explain and the server.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from fastapi.testclient import TestClient
from servekit import TEXT

import tinylm.device as device
from tinylm.cli import main
from tinylm.explain.attention import text_ids
from tinylm.generate.engine import generate
from tinylm.generate.inspect import drawable_logits
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.steps import fit_prompt
from tinylm.serve.app import create_app
from tinylm.serve.protocol import WARNING_HEADER

BUSY = {0: 0.97, 1: 0.03, 2: 0.88, 3: 0.0}  # cores 0 and 2 taken by other processes


@pytest.fixture
def busy_machine(monkeypatch):
    """Four cores, two of them busy; the thread counts PyTorch is given, in order."""
    monkeypatch.setattr(device, "_active", [])  # outside the suite's one-thread block: the commands choose
    monkeypatch.setattr(device, "available_cpus", lambda: 4)
    monkeypatch.setattr(device, "core_loads", lambda window=0.25: dict(BUSY))
    given: list[int] = []
    real = torch.set_num_threads

    def record(n: int) -> None:
        given.append(n)
        real(min(n, 2))  # the test machine's own cores; the count asked for is what is checked

    monkeypatch.setattr(torch, "set_num_threads", record)
    return given


def test_the_choice_names_the_busy_cores_and_a_setting_overrides_it(busy_machine):
    chosen = device.choose_threads(None, "cpu")
    assert (chosen.threads, chosen.left_out) == (2, (0, 2))
    assert "2 CPU threads: cores 0, 2 of 4 left out, busy" in chosen.line() and "--threads N" in chosen.line()
    assert device.choose_threads(None, "cpu", processes=2).threads == 1  # the free cores shared
    assert device.choose_threads(3, "cpu").line() == "threads: 3 CPU threads, as --threads set"
    with device.use_threads("cpu", None, log=busy_machine.append) as outer:
        with device.use_threads("cpu", None) as inner:  # a command inside a command: chosen and said once
            assert inner is outer
    assert busy_machine[:2] == [outer.line(), 2]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


COMMANDS = {
    "eval": lambda run, corpus, tmp: ["eval", "--run", run, "--corpus", corpus, "--tokens", "128"],
    "compare": lambda run, corpus, tmp: ["compare", run, "--corpus", corpus, "--tokens", "128",
                                         "--plot", str(tmp / "c.png")],
    "sample": lambda run, corpus, tmp: ["sample", "--run", run, "--prompt", "To be", "--max-new-tokens", "2"],
    "next-token": lambda run, corpus, tmp: ["next-token", "--run", run, "--prompt", "To be"],
    "explain sampling": lambda run, corpus, tmp: ["explain", "sampling", "--run", run, "--text", "To be"],
    "explain forward": lambda run, corpus, tmp: ["explain", "forward", "--run", run, "--text", "To be"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_leaves_the_busy_cores_out_and_threads_overrides(command, busy_machine, run_dir, corpus_file,
                                                                       tmp_path, capsys):
    argv = COMMANDS[command](str(run_dir), str(corpus_file), tmp_path)
    assert main(argv) == 0
    said = capsys.readouterr().err
    assert busy_machine[0] == 2  # four cores, two busy: two threads
    assert "tinylm: threads: 2 CPU threads: cores 0, 2 of 4 left out, busy with other work now" in said
    busy_machine.clear()
    assert main(argv + ["--threads", "3"]) == 0
    assert busy_machine[0] == 3 and "tinylm: threads:" not in capsys.readouterr().err  # asked for: not repeated


def test_serve_runs_on_the_free_cores_and_says_which(busy_machine, run_dir, monkeypatch, capsys):
    import tinylm.serve.server as server

    seen = []
    # the server runs (its scheduler thread starts) inside the choice; here it returns at once
    monkeypatch.setattr(server, "run_server", lambda app_server, sock: (seen.append(len(busy_machine)), sock.close()))
    server.serve(run_dir, port=0)
    assert busy_machine == [2, 1] and seen == [1]  # set to two, served, then put back
    assert "cores 0, 2 of 4 left out" in capsys.readouterr().err
    busy_machine.clear()
    server.serve(run_dir, port=0, threads=1)
    assert busy_machine[0] == 1


# ----- prompts longer than the context -----------------------------------------------------------------------

LONG = TEXT[:600]  # well over the test run's context of 64 tokens


def greedy_after(run, ids) -> int:
    """The token greedy decoding takes after exactly ``ids``, worked out from the model's logits."""
    return int(drawable_logits(run.model, run.tokenizer, ids).argmax())


def test_sample_next_token_and_explain_read_the_last_block_size_tokens_with_one_warning(run, run_dir, capsys):
    ids = run.start_ids + run.tokenizer.encode(LONG)
    block = run.model.config.block_size
    kept, warning = fit_prompt(ids, block)
    assert kept == ids[-block:] and warning.startswith(f"the prompt is {len(ids)} tokens, longer than")
    expected = greedy_after(run, kept)

    with pytest.warns(UserWarning) as said:
        [completion] = generate(run.model, run.tokenizer, LONG, SamplingParams(max_new_tokens=1, temperature=0),
                                start_ids=run.start_ids)
    assert completion.token_ids == [expected] and str(said[0].message) == warning

    assert main(["sample", "--run", str(run_dir), "--prompt", LONG, "--temperature", "0", "--max-new-tokens", "1",
                 "--threads", "1"]) == 0
    sample_err = capsys.readouterr().err
    assert main(["next-token", "--run", str(run_dir), "--prompt", LONG, "--top", "1", "--threads", "1"]) == 0
    out, next_err = capsys.readouterr()
    ranked_first = int(out.splitlines()[1].split()[1])  # rank, id, token, probability
    assert ranked_first == expected  # next-token's ranking and sample's greedy choice agree on a long text
    assert main(["explain", "sampling", "--run", str(run_dir), "--text", LONG, "--json", "--threads", "1"]) == 0
    table, explain_err = capsys.readouterr()
    assert json.loads(table)["tokens"][0]["id"] == expected
    for err in (sample_err, next_err, explain_err):
        assert f"tinylm: warning: {warning}" in err.splitlines()

    with pytest.warns(UserWarning) as said:
        assert text_ids(run.model, run.tokenizer, LONG, run.start_ids) == kept  # explain attention and forward
    assert str(said[0].message) == warning


def test_the_server_keeps_the_end_of_a_long_prompt_and_says_so(run):
    ids = run.start_ids + run.tokenizer.encode(LONG)
    block = run.model.config.block_size
    with TestClient(create_app(run)) as client, warnings.catch_warnings():
        warnings.simplefilter("error")  # the server says it in its replies, never with a Python warning
        answer = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1, "temperature": 0})
        assert answer.status_code == 200, answer.text
        kept, warning = fit_prompt(ids, block, room=1)  # its batches never slide: room for max_tokens
        assert answer.headers[WARNING_HEADER] == warning
        assert warning.startswith(f"the prompt is {len(ids)} tokens, longer than") and "keeping its last" in warning
        body = answer.json()
        assert body["usage"]["prompt_tokens"] == len(kept) == block - 1
        assert body["choices"][0]["text"] == run.tokenizer.decode([greedy_after(run, kept)])

        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": LONG}],
                                                         "max_tokens": 4})
        assert chat.status_code == 200 and "keeping its last 60 tokens" in chat.headers[WARNING_HEADER]

        chart = client.post("/next_token", json={"prompt": LONG, "top": 1}).json()  # the playground's chart
        assert chart["warning"] == fit_prompt(ids, block)[1] and chart["prompt_tokens"] == block
        assert chart["top"][0]["id"] == greedy_after(run, ids[-block:])
        inside = client.post("/explain/attention", json={"text": LONG, "layer": 0, "head": 0}).json()
        assert inside["warning"] == fit_prompt(ids, block)[1] and len(inside["tokens"]) == block

        short = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 1})
        assert WARNING_HEADER not in short.headers  # a prompt that fits: nothing cut, nothing said
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": block})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
