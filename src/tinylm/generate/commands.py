"""What `tinylm sample` and `tinylm next-token` do, as plain functions of their parsed flags.

The argparse definitions live in `tinylm.cli`; each subcommand calls one function here with its
`argparse.Namespace` (or anything with the same attributes). Everything these functions do is a
few calls into the library (`load_run`, `generate`, `stream`, `next_token_candidates`), which
is also how to do the same from Python.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from tinylm.device import ThreadChoice, use_threads
from tinylm.errors import TinyLMError
from tinylm.generate.engine import Completion, encode_prompts, generate, stream
from tinylm.generate.opening import opening_of_run
from tinylm.generate.inspect import format_candidates, left_out, next_token_candidates, temperature_table
from tinylm.generate.sampling import SamplingParams
from tinylm.generate.speculative import SpeculativeStats, load_draft, speculative_events, speculative_generate
from tinylm.generate.steps import keep_prompt


def unescape(text: str) -> str:
    r"""Turn the escapes \n, \t and \\ typed on a command line into the characters (--stop '\n\n')."""
    return re.sub(r"\\(n|t|\\)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def parse_temperatures(text: str) -> list[float]:
    """'0.5,1,2' -> [0.5, 1.0, 2.0]; each 0 or more."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise TinyLMError(f"--temperatures expects numbers separated by commas, e.g. 0.5,1,2; got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise TinyLMError(f"--temperatures expects numbers >= 0 separated by commas, got {text!r}")
    return values


def read_prompts(prompt: Sequence[str] | str | None, prompt_file: str | None, stdin: TextIO | None = None) -> list[str]:
    """The prompts: every --prompt, or the text of --prompt-file, or stdin when piped; else one empty prompt.

    An empty prompt samples from the start of a document (the run's start token alone).
    """
    stdin = sys.stdin if stdin is None else stdin
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and prompt_file:
        raise TinyLMError("give the prompt with --prompt or with --prompt-file, not both")
    if prompt:
        return list(prompt)
    if prompt_file:
        path = Path(prompt_file)
        if not path.is_file():
            raise TinyLMError(f"prompt file {path} does not exist; check the path")
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise TinyLMError(f"{path} is not valid UTF-8 (byte offset {e.start}); convert it to UTF-8 first") from None
    if stdin is not None and not stdin.isatty():
        return [stdin.read()]
    return [""]


def compile_flag(args: Any) -> bool:
    """Whether `tinylm sample --compile` asked for a compiled step (absent from other commands' flags)."""
    return bool(getattr(args, "compile", False))


def sampling_params(args: Any) -> SamplingParams:
    """The `SamplingParams` for parsed `tinylm sample` flags."""
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        num_samples=args.num_samples,
        stop=tuple(unescape(s) for s in (args.stop or ())),
        num_beams=args.num_beams,
    )


def format_completions(prompts: Sequence[str], completions: Sequence[Completion], num_samples: int) -> str:
    """The prompt and its completion; with several, each under a header naming prompt, sample and finish reason."""
    if len(completions) == 1:
        return prompts[0] + completions[0].text + "\n"
    parts = []
    for c in completions:
        parts.append(f"--- prompt {c.prompt_index + 1}, sample {c.sample_index + 1} of {num_samples} "
                     f"({c.finish_reason}, {len(c.token_ids)} tokens) ---\n")
        parts.append(prompts[c.prompt_index] + c.text + "\n")
    return "".join(parts)


def command_threads(args: Any) -> contextlib.AbstractContextManager[ThreadChoice]:
    """A command's CPU threads: ``args.threads`` (--threads) or the busy-core rule of `tinylm.device.use_threads`,
    said in one line on stderr (stdout keeps the text alone)."""
    return use_threads(getattr(args, "device", "cpu"), getattr(args, "threads", None),
                       log=lambda line: print(f"tinylm: {line}", file=sys.stderr))


def cmd_sample(args: Any, out: TextIO | None = None) -> int:
    """`tinylm sample`: load the run, complete the prompts, print (or stream) the text."""
    with contextlib.ExitStack() as threads:
        return _sample(args, out, threads)


def _sample(args: Any, out: TextIO | None, threads: contextlib.ExitStack) -> int:
    from tinylm.run import load_run

    out = sys.stdout if out is None else out
    params = sampling_params(args)
    prompts = read_prompts(args.prompt, args.prompt_file)
    if getattr(args, "draft", None):  # --draft where parsed
        check_draft_request(args, prompts)
    if compile_flag(args) and args.num_beams > 1:
        raise TinyLMError("--compile speeds up sampling and greedy decoding; beam search runs through the model's "
                          "own forward: drop --compile or --num-beams")
    run = load_run(args.run, checkpoint=getattr(args, "checkpoint", "best"))  # --checkpoint where parsed
    threads.enter_context(command_threads(args))  # after the checks and the load: an error there stays one line
    if prompts == [""]:  # no prompt: start where a speech or a paragraph starts, not at a title page
        opening = opening_of_run(run.info, params.seed)
        prompts = [opening.text]
        print(f"sample: starting from {opening.describe()}", file=sys.stderr)
    # no prompt at all: sample from the start of a document (BOS where the tokenizer puts nothing first)
    start = run.start_ids if any(prompts) else run.empty_prompt_ids
    if getattr(args, "draft", None):
        draft = load_draft(args.draft, run, log=lambda line: print(line, file=sys.stderr))
        ids = encode_prompts(run.tokenizer, prompts, start)[0]
        if args.stream:
            stats = SpeculativeStats()
            out.write(prompts[0])
            for event in speculative_events(run.model, ids, params, draft, k=args.draft_k, tokenizer=run.tokenizer,
                                            stats=stats, compile=compile_flag(args)):
                out.write(event.text)
                out.flush()
            out.write("\n")
        else:
            completion, stats = speculative_generate(run.model, ids, params, draft, k=args.draft_k,
                                                     tokenizer=run.tokenizer, compile=compile_flag(args))
            out.write(format_completions(prompts, [completion], 1))
        print(format_stats(stats), file=sys.stderr)
        return 0
    if args.stream:
        if len(prompts) != 1:
            raise TinyLMError("--stream shows one sample as it is written: give one prompt")
        out.write(prompts[0])
        for piece in stream(run.model, run.tokenizer, prompts[0], params, start_ids=start,
                            compile=compile_flag(args)):
            out.write(piece)
            out.flush()
        out.write("\n")
        return 0
    completions = generate(run.model, run.tokenizer, prompts, params, start_ids=start,
                           compile=compile_flag(args))
    out.write(format_completions(prompts, completions, params.num_samples))
    return 0


def check_draft_request(args: Any, prompts: Sequence[str]) -> None:
    """Refuse, in one line, what speculative decoding does not do (it decodes one sample of one prompt)."""
    if args.num_beams > 1:
        raise TinyLMError("--draft speeds up sampling and greedy decoding, not beam search: drop --num-beams or --draft")
    if len(prompts) != 1 or args.num_samples != 1:
        raise TinyLMError("--draft decodes one sample of one prompt: give one --prompt and --num-samples 1")


def format_stats(stats: SpeculativeStats) -> str:
    """One line on what the draft achieved (printed to stderr, so the text on stdout stays clean)."""
    return (f"speculative decoding: {stats.accepted} of {stats.proposed} drafted tokens kept "
            f"({100 * stats.acceptance_rate:.0f}%), {stats.tokens} tokens in {stats.forward_passes} model passes")


def cmd_next_token(args: Any, out: TextIO | None = None) -> int:
    """`tinylm next-token`: the most likely next tokens after the prompt, at one or several temperatures."""
    from tinylm.run import load_run

    out = sys.stdout if out is None else out
    if args.top < 1:
        raise TinyLMError(f"--top must be 1 or more, got {args.top}")
    run = load_run(args.run, checkpoint=getattr(args, "checkpoint", "best"))  # --checkpoint where parsed
    with command_threads(args):  # after the checks and the load: an error there stays one line
        return _next_token(args, run, out)


def _next_token(args: Any, run: Any, out: TextIO) -> int:
    # a prompt longer than the context: its last block_size tokens, as `tinylm sample` reads it
    ids = keep_prompt(list(run.start_ids) + run.tokenizer.encode(args.prompt), run.model.config.block_size)
    if args.temperatures:
        temps = parse_temperatures(args.temperatures)
        candidates, table = temperature_table(run.model, run.tokenizer, ids, temps, args.top)
        out.write(format_candidates(candidates, temps, table) + "\n")
    else:
        if args.temperature < 0:
            raise TinyLMError(f"--temperature must be 0 or more, got {args.temperature}")
        candidates = next_token_candidates(run.model, run.tokenizer, ids, args.top, args.temperature)
        out.write(format_candidates(candidates, temperature=args.temperature) + "\n")
    shown = [(i, p) for i, p in left_out(run.model, run.tokenizer, ids) if p >= 0.0005]
    if shown:
        names = ", ".join(f"{run.tokenizer.token_bytes(i).decode('utf-8', 'replace')} {100 * p:.1f}%" for i, p in shown)
        out.write(f"left out, as no sample takes them (their probability at temperature 1; the rest is rescaled): "
                  f"{names}\n")
    return 0
