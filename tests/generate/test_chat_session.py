"""`tinylm chat` and its library, `ChatSession`: replies the server would give, a history that fits the context.

The oracle for a reply is the server's own ``/v1/chat/completions`` and ``/tokenize`` on the same model and
messages (the app in the test process), so the terminal and the server cannot drift apart.

The models say known replies: tinylm GPTs whose attention and MLP write nothing to the residual stream (their
output projections are zero), so the next token depends on the current one alone, and whose head spells a
chain of bigrams after the prompt's last token (the trick of tests/serve/test_chat_templates.py's Llama, in a
tinylm GPT). The tokenizer is bare byte-level BPE, one token per byte, so lengths can be counted by hand:

- a base model (no template) reads the transcript, whose prompt ends with ``Assistant:``; it answers
  `` Yo\\nUser:``, which the transcript's stop string cuts to `` Yo`` and the leading space drop makes ``Yo``;
- a model with ChatML (`with_chat_tokens`) reads ``<|im_start|>assistant\\n``, answers ``Hé!`` (the é two
  byte tokens, printed as one character) and ends its turn with ``<|im_end|>``.
"""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tinylm.cli import main
from tinylm.cli.chat import converse
from tinylm.config import Config, GPTConfig, TrainConfig, dump_toml
from tinylm.errors import TinyLMError
from tinylm.generate.chat import ChatSession, MessageTooLong, reply_room
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.run import checkpoint_path, load_run, save_checkpoint, write_run_info
from tinylm.tokenizers import BPETokenizer
from tinylm.tokenizers.chat_format import ChatFormat
from tinylm.tokenizers.chat_template import with_chat_tokens

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
SYSTEM = "Be brief."


def bigram_gpt(vocab_size: int, chain: list[int], block_size: int, seed: int = 0) -> GPT:
    """A GPT whose greedy next token after ``chain[i]`` is ``chain[i + 1]``, whatever came before (module docstring):
    the head's row for ``chain[i + 1]`` is the final norm's output for ``chain[i]``, scaled; every other row zero."""
    d = 64
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=1, d_model=d, n_head=4, mlp="swiglu",
                       norm="rmsnorm", positions="rope", bias=False, tie_embeddings=False,
                       zero_init_projections=True)
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        model.E.weight.normal_()
        model.lm_head.weight.zero_()
        emb = model.E.weight
        normed = emb / emb.pow(2).mean(-1, keepdim=True).add(config.norm_eps).sqrt()  # (V, d), RMSNorm's gain is 1
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following] = normed[current] * (40.0 / d)
    return model


def byte_ids(tok, text: str) -> list[int]:
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    return ids


@pytest.fixture(scope="module")
def base_model():
    """(model, tokenizer, start ids): a base model that answers ``Yo`` in a 128-token context."""
    tok = BPETokenizer([], pattern="gpt2")
    return SimpleNamespace(model=bigram_gpt(tok.vocab_size, byte_ids(tok, ": Yo\nUser:"), 128), tokenizer=tok,
                           start_ids=[tok.eos_id])


@pytest.fixture(scope="module")
def chatml_model():
    """A model with ChatML's template that answers ``Hé!`` and ends its turn, in a 256-token context."""
    tok = with_chat_tokens(BPETokenizer([], pattern="gpt2"))
    chain = [*byte_ids(tok, "\nHé!"), tok.special_tokens["<|im_end|>"]]
    return SimpleNamespace(model=bigram_gpt(tok.vocab_size, chain, 256), tokenizer=tok, start_ids=[tok.eos_id])


def session_of(found, **options) -> ChatSession:
    return ChatSession(found.model, found.tokenizer, found.start_ids, **{"params": GREEDY, **options})


def write_run(folder, found):
    """``found``'s model and tokenizer as a run folder `load_run` reads, as `tinylm train` writes one."""
    config = Config(found.model.config, TrainConfig())
    save_checkpoint(checkpoint_path(folder, "best"), model_state=found.model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=found.tokenizer)
    (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder, {"status": "complete"})
    assert load_run(folder).start_ids == found.start_ids
    return folder


@pytest.fixture(scope="module")
def server():
    """A function: the app `tinylm serve` runs for a model, in this process, as a started test client."""
    from fastapi.testclient import TestClient

    from tinylm.serve.app import create_app

    clients = []

    def client_for(found):
        client = TestClient(create_app(SimpleNamespace(model=found.model, tokenizer=found.tokenizer,
                                                       start_ids=found.start_ids)))
        clients.append(client.__enter__())
        return client

    yield client_for
    for client in clients:
        client.__exit__(None, None, None)


def served_reply(client, messages, **sampling) -> tuple[list[int], str]:
    """The server's prompt ids (/tokenize) and reply (/v1/chat/completions) for ``messages``."""
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    answer = client.post("/v1/chat/completions", json={"messages": messages, **sampling}).json()
    return ids, answer["choices"][0]["message"]["content"]


# ----- the replies are the server's ------------------------------------------------------------------------


@pytest.mark.parametrize("which, reply, pieces", [("base_model", "Yo", ["Y", "o"]),
                                                  ("chatml_model", "Hé!", ["H", "é", "!"])])
def test_every_turns_prompt_and_greedy_reply_are_the_servers(request, server, which, reply, pieces):
    found = request.getfixturevalue(which)
    client = server(found)
    session = session_of(found, system=SYSTEM)
    for turn, text in enumerate(["Hi", "And a KV cache?", "Grüße 😀"]):
        messages = [*session.messages, {"role": "user", "content": text}]
        assert list(session.reply(text)) == pieces  # whole characters, as they come
        assert session.last_prompt == ChatFormat(found.tokenizer, found.start_ids).prompt_ids(messages)
        assert served_reply(client, messages, temperature=0, max_tokens=16) == (session.last_prompt, reply)
        assert session.messages == [*messages, {"role": "assistant", "content": reply}]
        assert len(session.messages) == 1 + 2 * (turn + 1) and session.dropped == 0


def test_a_seeded_sample_is_the_servers(request, server):
    """With random weights the replies vary; the same seed gives the server's reply, turn after turn."""
    tok = BPETokenizer([], pattern="gpt2")
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=128, n_layer=2, d_model=32, n_head=4, mlp="swiglu",
                       norm="rmsnorm", positions="rope", bias=False, init_std=0.25)
    found = SimpleNamespace(model=GPT(config).eval(), tokenizer=tok, start_ids=[tok.eos_id])
    client = server(found)
    session = session_of(found, params=SamplingParams(temperature=1.0, seed=7, max_new_tokens=12))
    replies = []
    for text in ["Hi", "Tell me more."]:
        messages = [*session.messages, {"role": "user", "content": text}]
        replies.append("".join(session.reply(text)))
        assert served_reply(client, messages, temperature=1.0, seed=7, max_tokens=12)[1] == replies[-1]
    assert replies[0] != replies[1] and all(replies)


# ----- the context ------------------------------------------------------------------------------------------


def test_the_oldest_turns_go_first_and_the_system_message_stays(base_model):
    """128 tokens, 16 kept for the reply: a prompt holds 112. One token of start, "System: Be brief.\\n" (18),
    a past turn "User: Hi\\nAssistant: Yo\\n" (23), the latest "User: Hi\\nAssistant:" (19): 38 + 23 per turn."""
    session = session_of(base_model, system=SYSTEM)
    for turns in range(4):  # 38, 61, 84, 107 tokens: all fit
        assert "".join(session.reply("Hi")) == "Yo"
        assert (len(session.last_prompt), session.dropped) == (38 + 23 * turns, 0)
    assert "".join(session.reply("Hi")) == "Yo"  # 130 tokens with the 4 turns: the oldest goes
    assert (len(session.last_prompt), session.dropped) == (107, 1)
    long = "x" * 30  # its prompt is 19 + 18 + 30 + 23 per turn: 135 with 3 turns, 112 with 2
    assert "".join(session.reply(long)) == "Yo"
    assert (len(session.last_prompt), session.dropped) == (112, 2)
    hi, yo = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}
    assert session.messages == [{"role": "system", "content": SYSTEM}, hi, yo, hi, yo,
                                {"role": "user", "content": long}, yo]
    assert session.last_prompt == [base_model.tokenizer.eos_id] + base_model.tokenizer.encode(
        f"System: {SYSTEM}\nUser: Hi\nAssistant: Yo\nUser: Hi\nAssistant: Yo\nUser: {long}\nAssistant:")


def test_a_message_too_long_even_alone_is_not_sent_and_the_conversation_stays(base_model):
    session = session_of(base_model, system=SYSTEM)
    assert "".join(session.reply("Hi")) == "Yo"
    before = session.messages
    with pytest.raises(MessageTooLong) as refused:  # 19 + 17 + 80 = 116 tokens > 112
        session.reply("y" * 80)
    assert str(refused.value) == ("message not sent: it makes a prompt of 116 tokens with the system message, and "
                                  "the model's 128-token context holds 112 beside the 16 kept for the reply; "
                                  "shorten it")
    assert session.messages == before
    assert "".join(session.reply("y" * 76)) == "Yo" and session.dropped == 1  # 112 alone: the turn before goes


def test_a_system_message_or_a_reply_that_leaves_no_room_is_one_line(base_model):
    with pytest.raises(TinyLMError, match="^the system message makes a prompt of 127 tokens"):
        session_of(base_model, system="s" * 100)  # 1 + 109 + 7 + 10: an empty user line and "Assistant:"
    with pytest.raises(TinyLMError, match="leaves no room for the conversation in the model's 128-token context"):
        session_of(base_model, params=SamplingParams(max_new_tokens=128))
    assert reply_room(1024) == 128 and reply_room(64) == 32  # the default: 128, or half a small context


def test_a_reply_stopped_early_stays_as_far_as_it_was_shown(chatml_model):
    session = session_of(chatml_model)
    pieces = session.reply("Hi")
    assert next(pieces) == "H"
    pieces.close()  # what Ctrl-C does to a reply being printed
    assert session.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "H"}]
    session.reply("Hi").close()  # stopped before anything was shown: no turn
    assert len(session.messages) == 2
    session.reset()
    assert session.messages == [] and "".join(session.reply("Hi")) == "Hé!"
    assert session.last_prompt == chatml_model.tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n"
                                                                "<|im_start|>assistant\n", allowed_special="all")


# ----- the command ------------------------------------------------------------------------------------------


class Piped(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_the_loop_ignores_empty_lines_resets_and_exits(base_model):
    out, err = io.StringIO(), io.StringIO()
    session = session_of(base_model)
    lines = Piped("Hi\n\n   \nHi\n/reset\nHi\n/exit\nHi\n")
    assert converse(session, lines, out, err) == 0
    assert out.getvalue() == "Yo\nYo\nYo\n"  # nothing after /exit
    assert err.getvalue() == "chat: the conversation starts over\n"
    assert len(session.messages) == 2


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on():
    class Interrupted:
        context, dropped = 128, 0

        def __init__(self):
            self.texts = []

        def reply(self, text):
            self.texts.append(text)
            yield "par"
            if len(self.texts) == 1:
                raise KeyboardInterrupt
            yield "t two"

    out, err = io.StringIO(), io.StringIO()
    session = Interrupted()
    assert converse(session, Piped("one\ntwo\n"), out, err) == 0
    assert out.getvalue() == "par\npart two\n" and err.getvalue() == "chat: reply stopped\n"
    assert session.texts == ["one", "two"]


def test_at_a_terminal_each_line_follows_a_prompt(base_model):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = io.StringIO(), io.StringIO()
    assert converse(session_of(base_model), Terminal("Hi\n"), out, err) == 0
    assert out.getvalue() == "you> Yo\nyou> "
    assert err.getvalue() == "chat: /reset starts over, /exit or Ctrl-D ends, Ctrl-C stops a reply\n"


def chat_command(run_dir, stdin: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "chat", "--run", str(run_dir), "--threads", "1", *flags],
                          input=stdin, capture_output=True, text=True, encoding="utf-8", timeout=300)


def test_the_command_reads_a_piped_conversation(base_model, tmp_path):
    run_dir = write_run(tmp_path / "base", base_model)
    stdin = "Hi\n" * 5 + "x" * 30 + "\n" + "y" * 80 + "\n/reset\n\nHi\n"
    done = chat_command(run_dir, stdin, "--temperature", "0", "--max-new-tokens", "16", "--system", SYSTEM)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Yo\n" * 7
    chat_lines = [line for line in done.stderr.splitlines() if line.startswith("chat: ")]
    assert chat_lines == [
        "chat: dropped the oldest turn to fit the 128-token context (16 kept for the reply)",
        "chat: dropped the 2 oldest turns to fit the 128-token context (16 kept for the reply)",
        "chat: message not sent: it makes a prompt of 116 tokens with the system message, and the model's "
        "128-token context holds 112 beside the 16 kept for the reply; shorten it",
        "chat: the conversation starts over"]
    assert "Traceback" not in done.stderr


def test_the_command_talks_through_the_runs_template(chatml_model, tmp_path):
    run_dir = write_run(tmp_path / "chatml", chatml_model)
    done = chat_command(run_dir, "Hi\nGrüße\n/exit\nnot read\n", "--temperature", "0")
    assert (done.returncode, done.stdout) == (0, "Hé!\nHé!\n"), done.stderr


def test_bad_input_is_one_line(base_model, tmp_path, capsys, monkeypatch):
    run_dir = write_run(tmp_path / "base", base_model)
    for argv, needle in ((["--run", str(tmp_path / "missing")], "missing"),
                         (["--run", str(run_dir), "--max-new-tokens", "200"], "leaves no room"),
                         (["--run", str(run_dir), "--top-p", "2"], "--top-p: expected a number between 0 and 1")):
        try:
            status = main(["chat", *argv])
        except SystemExit as e:  # a bad flag value: argparse's one line
            status = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1 and needle in err[0], err

    class CtrlC(Piped):
        def readline(self, *args):
            raise KeyboardInterrupt

    monkeypatch.setattr(sys, "stdin", CtrlC())  # Ctrl-C at the prompt ends the chat like any command
    assert main(["chat", "--run", str(run_dir), "--threads", "1"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "tinylm: interrupted"
