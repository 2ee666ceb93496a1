"""`tinylm sample` and `tinylm next-token`: text from a trained run, as plain functions of their parsed flags.

Each command reads its flags and calls the library (`load_run`, `generate`, `stream`,
`speculative_generate`, `next_token_candidates`), which is also how to do the same from Python; what is
here is reading prompts and flags, and printing.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tinylm.cli.flags import (
    add_command,
    add_run_flags,
    add_sampling_flags,
    add_threads_flag,
    command_threads,
    nonneg_float,
    parse_temperatures,
    positive_int,
)
from tinylm.errors import TinyLMError

if TYPE_CHECKING:
    from tinylm.generate.engine import Completion
    from tinylm.generate.sampling import SamplingParams
    from tinylm.generate.speculative import SpeculativeStats


def unescape(text: str) -> str:
    r"""Turn the escapes \n, \t and \\ typed on a command line into the characters (--stop '\n\n')."""
    return re.sub(r"\\(n|t|\\)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


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


def add_quant_flag(p: argparse.ArgumentParser) -> None:
    """--quant int8: decode with the GPT's matrices in int8 (`tinylm.model.quant`)."""
    p.add_argument("--quant", choices=["int8"],
                   help="decode with the model's block matrices and head stored as int8 with one scale per row "
                   "(a quarter of the bytes; the kernel is chosen by timing on first use): faster on a CPU, with "
                   "logits within about 1%% of float32's; GPT models only (default: float32)")


def quantize_flag(model: Any, args: Any) -> None:
    """Quantize a loaded run's model in place as --quant asks (absent or None: leave it float32)."""
    kind = getattr(args, "quant", None)
    if kind:
        from tinylm.model.quant import check_quantizable, quantize_int8

        check_quantizable(model, kind)
        quantize_int8(model)


def sampling_params(args: Any) -> SamplingParams:
    """The `SamplingParams` for parsed `tinylm sample` flags."""
    from tinylm.generate.sampling import SamplingParams

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


def cmd_sample(args: Any, out: TextIO | None = None) -> int:
    """Complete prompts with a trained model: sampling (temperature, top-k, top-p, min-p; applied in that order),
    greedy decoding (--temperature 0) or beam search (--num-beams). The prompt comes from --prompt (repeat it for a
    batch), --prompt-file, or stdin; with none, samples start a new document. Prints each prompt and its
    completion."""
    # ``out`` is where the text goes (stdout unless a caller, such as a test, passes its own)
    with contextlib.ExitStack() as threads:
        return _sample(args, out, threads)


def _sample(args: Any, out: TextIO | None, threads: contextlib.ExitStack) -> int:
    from tinylm.generate.engine import check_compile, generate, stream
    from tinylm.generate.opening import opening_of_run
    from tinylm.run import load_run

    out = sys.stdout if out is None else out
    params = sampling_params(args)
    prompts = read_prompts(args.prompt, args.prompt_file)
    if getattr(args, "draft", None):  # --draft where parsed
        check_draft_request(args, prompts)
    check_compile(params, compile_flag(args))  # before the run loads
    run = load_run(args.run, checkpoint=getattr(args, "checkpoint", "best"))  # --checkpoint where parsed
    quantize_flag(run.model, args)
    threads.enter_context(command_threads(args))  # after the checks and the load: an error there stays one line
    if prompts == [""]:  # no prompt: start where a speech or a paragraph starts, not at a title page
        opening = opening_of_run(run.info, params.seed)
        prompts = [opening.text]
        print(f"sample: starting from {opening.describe()}", file=sys.stderr)
    # no prompt at all: sample from the start of a document (BOS where the tokenizer puts nothing first)
    start = run.start_ids if any(prompts) else run.empty_prompt_ids
    if getattr(args, "draft", None):
        return _sample_with_draft(args, run, prompts[0], start, params, out)
    if args.stream:
        if len(prompts) != 1:
            raise TinyLMError("--stream shows one sample as it is written: give one prompt")
        shown = False  # the prompt goes out with the first piece: after what the engine says on stderr as it starts
        for piece in stream(run.model, run.tokenizer, prompts[0], params, start_ids=start,
                            compile=compile_flag(args)):
            if not shown:
                out.write(prompts[0])
                shown = True
            out.write(piece)
            out.flush()
        out.write(("" if shown else prompts[0]) + "\n")
        return 0
    completions = generate(run.model, run.tokenizer, prompts, params, start_ids=start,
                           compile=compile_flag(args))
    out.write(format_completions(prompts, completions, params.num_samples))
    return 0


def _sample_with_draft(args: Any, run: Any, prompt: str, start: Sequence[int], params: SamplingParams,
                       out: TextIO) -> int:
    """`tinylm sample --draft`: one prompt's one sample by speculative rounds, then what the draft achieved."""
    from tinylm.generate.engine import encode_prompts
    from tinylm.generate.speculative import SpeculativeStats, load_draft, speculative_events, speculative_generate

    draft = load_draft(args.draft, run, log=lambda line: print(line, file=sys.stderr))
    ids = encode_prompts(run.tokenizer, [prompt], start)[0]
    if args.stream:
        stats = SpeculativeStats()
        out.write(prompt)
        for event in speculative_events(run.model, ids, params, draft, k=args.draft_k, tokenizer=run.tokenizer,
                                        stats=stats, compile=compile_flag(args)):
            out.write(event.text)
            out.flush()
        out.write("\n")
    else:
        completion, stats = speculative_generate(run.model, ids, params, draft, k=args.draft_k,
                                                 tokenizer=run.tokenizer, compile=compile_flag(args))
        out.write(format_completions([prompt], [completion], 1))
    print(format_stats(stats), file=sys.stderr)
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
    """Print the model's top candidates for the token after --prompt, with their probabilities at --temperature, or
    side by side at several --temperatures."""
    from tinylm.run import load_run

    out = sys.stdout if out is None else out
    if args.top < 1:
        raise TinyLMError(f"--top must be 1 or more, got {args.top}")
    run = load_run(args.run, checkpoint=getattr(args, "checkpoint", "best"))  # --checkpoint where parsed
    with command_threads(args):  # after the checks and the load: an error there stays one line
        return _next_token(args, run, out)


def _next_token(args: Any, run: Any, out: TextIO) -> int:
    from tinylm.generate.inspect import format_candidates, left_out, next_token_candidates, temperature_table
    from tinylm.generate.steps import keep_prompt

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


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm sample and next-token."""
    p = add_command(sub, "sample", cmd_sample, "generate text from a trained run")
    add_run_flags(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt; give it several times to complete several prompts in one batch")
    src.add_argument("--prompt-file", metavar="PATH", help="read one prompt from this UTF-8 file")
    p.add_argument("--num-samples", type=positive_int, default=1, metavar="N", help="samples per prompt (default: 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens to generate (default: 256)")
    add_sampling_flags(p)
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop a sample at this text (not included in the output; \\n and \\t are understood); "
                   "repeat for several; the end-of-text token always stops")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated (one prompt, one sample)")
    p.add_argument("--num-beams", type=positive_int, default=1, metavar="N",
                   help="beam search with this many beams instead of sampling (default: 1, no beam search)")
    p.add_argument("--draft", metavar="ngram|prompt|DIR",
                   help="speculative decoding: a draft proposes tokens the model checks several at a time, with "
                   "the same output distribution; 'ngram' drafts with an n-gram counted on the run's training "
                   "tokens (counted on first use, kept in the run folder), 'prompt' looks the text's last words "
                   "up earlier in the text, a run folder (same tokenizer) drafts with its model; one prompt, "
                   "one sample (default: off)")
    p.add_argument("--draft-k", type=positive_int, default=4, metavar="N",
                   help="the most tokens drafted per model pass, adapted to how many get kept (default: 4)")
    p.add_argument("--compile", action="store_true",
                   help="compile a GPT's one-token step with torch.compile, used where it times faster than the "
                   "eager step: 15-40 s the first time, about 5 s after (torch caches it); worth it for long "
                   "or many samples (default: off)")
    add_quant_flag(p)
    add_threads_flag(p)

    p = add_command(sub, "next-token", cmd_next_token, "show the most likely next tokens after a prompt")
    add_run_flags(p)
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--top", type=positive_int, default=10, metavar="N", help="how many candidates (default: 10)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="the temperature of the probabilities (default: 1.0)")
    p.add_argument("--temperatures", metavar="T1,T2,...",
                   help="show the probabilities at several temperatures side by side, e.g. 0.5,1,2")
    add_threads_flag(p)
