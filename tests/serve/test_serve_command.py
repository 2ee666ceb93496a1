"""`tinylm serve` as a user runs it: mistakes are one line and exit status 2, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from servekit import CommandServer

import tinylm.serve.server as server_module
from tinylm.cli import main
from tinylm.serve.server import is_loopback, url_for


def tinylm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, phrase: str) -> None:
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_run_folder(tmp_path):
    assert_one_line_error(tinylm("serve", "--run", str(tmp_path / "missing_dir")), "does not exist")


def test_a_port_in_use(run_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = tinylm("serve", "--run", str(run_dir), "--port", str(port))
    assert_one_line_error(result, f"port {port} on 127.0.0.1 is already in use")


@pytest.mark.parametrize("flags, phrase", [
    (["--port", "70000"], "expected a port number"),
    (["--max-batch-size", "0"], "expected a positive integer"),
    (["--batch-window-ms", "-1"], "expected a number >= 0"),
    ([], "the following arguments are required: --run"),
])
def test_bad_flags(flags, phrase, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags] + (["--run", "x"] if flags else []))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0]


def test_flags_and_the_api_key_variable_reach_serve(monkeypatch):
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda run, **options: calls.append((run, options)))
    monkeypatch.setenv("TINYLM_API_KEY", "from-env")
    assert main(["serve", "--run", "runs/x", "--port", "9000", "--max-batch-size", "4", "--batch-window-ms", "5"]) == 0
    assert main(["serve", "--run", "runs/x", "--api-key", "from-flag"]) == 0
    monkeypatch.delenv("TINYLM_API_KEY")
    assert main(["serve", "--run", "runs/x"]) == 0
    (run, first), (_, second), (_, third) = calls
    assert run == "runs/x" and first["host"] == "127.0.0.1" and first["port"] == 9000
    assert first["max_batch_size"] == 4 and first["batch_window"] == pytest.approx(0.005)
    assert (first["api_key"], second["api_key"], third["api_key"]) == ("from-env", "from-flag", None)


def test_the_command_serves_on_loopback_by_default(server):
    assert server.base_url.startswith("http://127.0.0.1:")


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_flag_is_refused_not_read_as_no_key(key, monkeypatch, capsys):
    """`--api-key ""` would otherwise switch off the key set in $TINYLM_API_KEY without a word."""
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda run, **options: calls.append(options))
    monkeypatch.setenv("TINYLM_API_KEY", "from-env")
    assert main(["serve", "--run", "runs/x", "--api-key", key]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--api-key is empty" in err[0] and not calls


def test_a_blank_api_key_variable_and_an_empty_model_name_are_refused(monkeypatch, capsys):
    """Spaces in $TINYLM_API_KEY are no key a client could send; the error names the variable, not Python's None."""
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda run, **options: calls.append(options))
    monkeypatch.setenv("TINYLM_API_KEY", "  ")
    assert main(["serve", "--run", "runs/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$TINYLM_API_KEY" in err[0] and "None" not in err[0]
    monkeypatch.setenv("TINYLM_API_KEY", "")  # empty: no key, as documented
    assert main(["serve", "--run", "runs/x"]) == 0 and calls[-1]["api_key"] is None
    for name in ("", " "):
        assert main(["serve", "--run", "runs/x", "--model-name", name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--model-name is empty" in err[0]
    assert len(calls) == 1


def test_a_port_in_use_is_reported_before_the_model_is_loaded(run_dir, monkeypatch, capsys):
    import tinylm.run

    loaded = []
    monkeypatch.setattr(tinylm.run, "load_run", lambda *a, **k: loaded.append(a))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--run", str(run_dir), "--port", str(busy.getsockname()[1])]) == 2
    assert "already in use" in capsys.readouterr().err and not loaded


def test_listening_beyond_loopback_without_a_key_is_warned_about(run_dir, tmp_path):
    served = CommandServer(run_dir, tmp_path, "--host", "0.0.0.0")
    try:
        assert served.base_url.startswith("http://127.0.0.1:")  # a URL a browser can open, not 0.0.0.0
        warning = served.stderr.read_text().splitlines()[0]
        assert warning.startswith("tinylm: warning: listening on 0.0.0.0") and "--api-key" in warning
    finally:
        served.close()
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.5")
    assert url_for("::", 80) == "http://[::1]:80" and url_for("10.0.0.2", 80) == "http://10.0.0.2:80"


@pytest.mark.parametrize("origin", ["http://localhost:3000/", "localhost:3000", ""])
def test_an_origin_that_is_not_one_is_refused(origin, capsys):
    assert main(["serve", "--run", "runs/x", "--allow-origin", origin]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not an origin" in err[0]


def test_two_servers_cannot_share_a_port_even_when_both_reuse_addresses():
    """Both sockets set SO_REUSEADDR (a restarted server must not wait out TIME_WAIT): on Linux both may bind the
    port until one listens, so the socket listens as it binds, and the second is refused in one line there."""
    from tinylm.errors import TinyLMError
    from tinylm.serve.server import bind_socket

    first = bind_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(TinyLMError, match=f"port {port} on 127.0.0.1 is already in use"):
            bind_socket("127.0.0.1", port)
    finally:
        first.close()


def test_serve_with_a_draft_answers_greedy_requests_with_the_librarys_text(run_dir, run, tmp_path):
    """`tinylm serve --draft prompt`: the official client gets the text `tinylm sample` gives, and /health counts drafts."""
    import httpx
    import openai

    from tinylm.generate import SamplingParams, generate

    served = CommandServer(run_dir, tmp_path, "--draft", "prompt", "--draft-k", "3")
    try:
        client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompt = "To be, or not to be, to be, or not"
        out = client.completions.create(model=run_dir.name, prompt=prompt, max_tokens=30, temperature=0)
        expected = generate(run.model, run.tokenizer, prompt, SamplingParams(max_new_tokens=30, temperature=0),
                            start_ids=run.start_ids)[0]
        assert out.choices[0].text == expected.text
        health = httpx.get(served.base_url + "/health").json()
    finally:
        served.close()
    assert health["scheduler"]["drafted"] > 0, health


def test_serve_refuses_a_draft_it_cannot_make_in_one_line(run_dir, capsys):
    assert main(["serve", "--run", str(run_dir), "--port", "0", "--draft", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no n-gram draft" in err[0], err


def test_python_callers_get_the_commands_policy(run, monkeypatch):
    """`serve()` reads $TINYLM_API_KEY and checks its options before it binds or loads anything, and `create_app`
    refuses what the command refuses, in the same words."""
    from tinylm.errors import TinyLMError
    from tinylm.serve import create_app, serve

    monkeypatch.setenv("TINYLM_API_KEY", "  ")
    with pytest.raises(TinyLMError, match=r"\$TINYLM_API_KEY holds only spaces"):
        serve("runs/missing")
    monkeypatch.delenv("TINYLM_API_KEY")
    with pytest.raises(TinyLMError, match="is not an origin"):
        serve("runs/missing", allow_origins=["http://localhost:3000/"])
    for options, phrase in [({"allow_origins": ["localhost:3000"]}, "is not an origin"),
                            ({"model_name": " "}, "model_name"), ({"api_key": ""}, "api_key"),
                            ({"body_timeout": 0}, "above 0")]:
        with pytest.raises(TinyLMError, match=phrase):
            create_app(run, **options)
