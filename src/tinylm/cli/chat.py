"""`tinylm chat`: a conversation with a trained run in the terminal, as a plain function of its parsed flags.

The conversation itself (the history, its rendering, fitting it to the context, a reply as text pieces) is
`tinylm.generate.chat.ChatSession`, which is also how to chat from Python; what is here is reading the user's
lines, the chat's two commands, and printing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from tinylm.cli.flags import (
    add_command,
    add_run_flags,
    add_sampling_flags,
    add_threads_flag,
    command_threads,
    positive_int,
)
from tinylm.cli.generate import add_quant_flag, quantize_flag
from tinylm.errors import TinyLMError

if TYPE_CHECKING:
    from tinylm.generate.chat import ChatSession
    from tinylm.generate.sampling import SamplingParams

PROMPT = "you> "
RESET, EXIT = "/reset", "/exit"


def chat_sampling(args: Any, context: int) -> SamplingParams:
    """The `SamplingParams` of parsed `tinylm chat` flags, in a ``context``-token model (--max-new-tokens unset:
    `tinylm.generate.chat.reply_room`)."""
    from tinylm.generate.chat import reply_room
    from tinylm.generate.sampling import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens or reply_room(context), temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def cmd_chat(args: Any, stdin: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Talk with a trained run: type a message, read the reply as it is written, and go on; every reply sees
    the conversation so far, through the model's chat template (a run fine-tuned by `tinylm finetune`, an
    imported chat model) or, for a model without one, a plain "User:/Assistant:" transcript, as `tinylm serve`
    renders the same messages. When the conversation outgrows the model's context, the oldest turns are dropped
    (never the --system message), and a line on stderr says so. Lines piped on stdin are read as the user's
    messages, one a line. An empty line is ignored; /reset starts the conversation over; /exit or Ctrl-D ends
    it; Ctrl-C stops a reply and returns to the prompt. Each turn reuses the previous turn's keys and values for the
    part of the conversation they share, and runs the model on the rest only (--no-prefix-cache: every turn reads
    the whole conversation)."""
    from tinylm.generate.chat import ChatSession
    from tinylm.run import load_run

    run = load_run(args.run, checkpoint=args.checkpoint)
    quantize_flag(run.model, args)
    params = chat_sampling(args, run.model.config.block_size)
    with command_threads(args):  # after the load: an error there stays one line
        session = ChatSession(run.model, run.tokenizer, run.start_ids, system=args.system, params=params,
                              prefix_cache=not args.no_prefix_cache)
        return converse(session, sys.stdin if stdin is None else stdin, sys.stdout if out is None else out,
                        sys.stderr if err is None else err)


def converse(session: ChatSession, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    """The conversation loop: read a line, answer it, until EOF or /exit (status 0). Ctrl-C while waiting for a
    line is not caught here: the command ends with status 130 like every other."""
    from tinylm.generate.chat import MessageTooLong

    terminal = stdin.isatty()
    if terminal:
        say(err, f"{RESET} starts over, {EXIT} or Ctrl-D ends, Ctrl-C stops a reply")
    for line in read_lines(stdin, out, terminal):
        text = line.strip()
        if not text:
            continue
        if text == EXIT:
            break
        if text == RESET:
            session.reset()
            say(err, "the conversation starts over")
            continue
        try:
            pieces = session.reply(text)
        except MessageTooLong as e:
            say(err, str(e))
            continue
        if session.dropped:
            turns = "the oldest turn" if session.dropped == 1 else f"the {session.dropped} oldest turns"
            say(err, f"dropped {turns} to fit the {session.context}-token context "
                f"({session.params.max_new_tokens} kept for the reply)")
        show_reply(pieces, out, err)
    return 0


def say(err: TextIO, line: str) -> None:
    """A line about the chat, on stderr: stdout holds the replies alone."""
    print(f"chat: {line}", file=err, flush=True)


def read_lines(stdin: TextIO, out: TextIO, terminal: bool) -> Iterator[str]:
    """The user's lines until EOF: after a "you> " prompt at a terminal (with line editing where Python has
    it), plain lines from a pipe."""
    if terminal and stdin is sys.stdin and out is sys.stdout:
        try:
            import readline  # noqa: F401  (imported for its side effect: input() gets line editing and history)
        except ImportError:  # not on every platform
            pass
        while True:
            try:
                yield input(PROMPT)
            except EOFError:
                out.write("\n")  # Ctrl-D leaves the cursor after the prompt
                return
            except KeyboardInterrupt:
                out.write("\n")  # so does Ctrl-C, which ends the command (status 130)
                out.flush()
                raise
    while True:
        if terminal:
            out.write(PROMPT)
            out.flush()
        try:
            line = stdin.readline()
        except UnicodeDecodeError as e:
            raise TinyLMError(f"stdin is not valid UTF-8 (byte {e.start} of a read); send UTF-8 text") from None
        if not line:
            return
        yield line


def show_reply(pieces: Iterator[str], out: TextIO, err: TextIO) -> None:
    """Print a reply as it comes; Ctrl-C stops it (what was shown stays in the conversation) and returns."""
    try:
        for piece in pieces:
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()
        out.write("\n")
        out.flush()
        say(err, "reply stopped")
        return
    out.write("\n")
    out.flush()


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm chat."""
    p = add_command(sub, "chat", cmd_chat, "talk with a trained run in the terminal, turn by turn")
    add_run_flags(p)
    p.add_argument("--system", metavar="TEXT", help="the system message, kept however long the conversation grows")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                   help="most tokens of a reply, kept free in the context beside the conversation "
                   "(default: 128, or half the context if that is less)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="read the whole conversation afresh every turn instead of reusing the previous turn's keys "
                   "and values for the part they share (the replies are the same up to float rounding)")
    add_sampling_flags(p, seed_help="make the replies reproducible")
    add_threads_flag(p)
    add_quant_flag(p)
