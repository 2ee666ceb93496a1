"""The functions behind `tinylm sample` and `tinylm next-token`, on a stand-in for a loaded run."""

from __future__ import annotations

import argparse
import io
from types import SimpleNamespace

import pytest

from tinylm.errors import TinyLMError
from tinylm.cli import generate as commands
from tinylm.cli.flags import parse_temperatures
from tinylm.cli.generate import cmd_next_token, cmd_sample, read_prompts, unescape

from toys import ScriptedLM


@pytest.fixture
def fake_run(byte_tokenizer, monkeypatch):
    """`load_run` replaced by a run whose model says " to be\\n\\nor not" after "<eos>To be, or not".

    (The model goes by position, so any prompt of the same length gets the same continuation.)
    """
    tok = byte_tokenizer
    start = [tok.eos_id]
    script = start + tok.encode("To be, or not") + tok.encode(" to be\n\nor not") + [tok.eos_id]
    run = SimpleNamespace(model=ScriptedLM(script, tok.vocab_size), tokenizer=tok, start_ids=start)
    import tinylm.run

    monkeypatch.setattr(tinylm.run, "load_run", lambda path, *a, **k: run)
    return run


def sample_args(**changes) -> argparse.Namespace:
    args = dict(run="runs/x", prompt=["To be, or not"], prompt_file=None, num_samples=1, max_new_tokens=50,
                temperature=0.0, top_k=None, top_p=None, min_p=None, seed=None, stop=None, stream=False, num_beams=1)
    args.update(changes)
    return argparse.Namespace(**args)


def run_sample(**changes) -> str:
    out = io.StringIO()
    assert cmd_sample(sample_args(**changes), out=out) == 0
    return out.getvalue()


def test_sample_prints_the_prompt_and_its_completion(fake_run):
    assert run_sample() == "To be, or not to be\n\nor not\n"


def test_sample_with_a_stop_string_typed_with_escapes(fake_run):
    assert run_sample(stop=[r"\n\n"]) == "To be, or not to be\n"


def test_streaming_prints_the_same_text(fake_run):
    assert run_sample(stream=True, stop=[r"\n\n"]) == run_sample(stop=[r"\n\n"])


def test_several_samples_each_get_a_header(fake_run):
    text = run_sample(num_samples=2, max_new_tokens=3)
    assert text.count("--- prompt 1, sample") == 2 and "sample 2 of 2 (length, 3 tokens)" in text


def test_streaming_several_prompts_is_an_error(fake_run):
    with pytest.raises(TinyLMError, match="one prompt"):
        run_sample(stream=True, prompt=["a", "b"])


def test_next_token_prints_a_table(fake_run):
    out = io.StringIO()
    args = argparse.Namespace(run="runs/x", prompt="To be, or not", top=3, temperature=1.0, temperatures=None)
    assert cmd_next_token(args, out=out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[1].split()[:2] == ["1", "32"]  # the space (byte 32) comes next
    args.temperatures = "0.5,1,2"
    out = io.StringIO()
    cmd_next_token(args, out=out)
    assert out.getvalue().splitlines()[0].split()[-3:] == ["T=0.5", "T=1", "T=2"]


def test_prompts_come_from_flags_a_file_or_stdin(tmp_path):
    assert read_prompts(["a", "b"], None) == ["a", "b"]
    path = tmp_path / "p.txt"
    path.write_text("from a file\n", encoding="utf-8")
    assert read_prompts(None, str(path)) == ["from a file\n"]
    piped = io.StringIO("from stdin")
    assert read_prompts(None, None, stdin=piped) == ["from stdin"]
    with pytest.raises(TinyLMError, match="not both"):
        read_prompts(["a"], str(path))
    with pytest.raises(TinyLMError, match="does not exist"):
        read_prompts(None, str(tmp_path / "missing.txt"))


def test_flag_helpers():
    assert unescape(r"a\n\tb\\n") == "a\n\tb\\n"
    assert parse_temperatures("0.5, 1,2") == [0.5, 1.0, 2.0]
    for bad in ("a,b", "-1", ""):
        with pytest.raises(TinyLMError):
            parse_temperatures(bad)
    assert commands.sampling_params(sample_args(stop=[r"\n"])).stop == ("\n",)
