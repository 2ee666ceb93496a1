"""`tinylm sample` and `tinylm next-token`: text from a trained run.

The flags are defined here; what each command does lives in `tinylm.generate.commands`.
"""

from __future__ import annotations

import argparse

from tinylm.cli.flags import add_threads_flag, nonneg_float, positive_int, probability, seed_int


def cmd_sample(args: argparse.Namespace) -> int:
    from tinylm.generate.commands import cmd_sample as sample

    return sample(args)


def cmd_next_token(args: argparse.Namespace) -> int:
    from tinylm.generate.commands import cmd_next_token as next_token

    return next_token(args)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm sample and next-token."""
    # tinylm sample / next-token
    p = sub.add_parser("sample", help="generate text from a trained run",
                       description="Complete prompts with a trained model: sampling (temperature, top-k, top-p, "
                       "min-p; applied in that order), greedy decoding (--temperature 0) or beam search "
                       "(--num-beams). The prompt comes from --prompt (repeat it for a batch), --prompt-file, "
                       "or stdin; with none, samples start a new document. Prints each prompt and its completion.")
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="a prompt; give it several times to complete several prompts in one batch")
    src.add_argument("--prompt-file", metavar="PATH", help="read one prompt from this UTF-8 file")
    p.add_argument("--num-samples", type=positive_int, default=1, metavar="N", help="samples per prompt (default: 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="most tokens to generate (default: 256)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="divide the logits by this; 0 is greedy decoding (default: 1.0)")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="keep only the k most likely tokens (default: off)")
    p.add_argument("--top-p", type=probability, metavar="P",
                   help="keep the smallest set of most likely tokens whose probability reaches p (default: off)")
    p.add_argument("--min-p", type=probability, metavar="P",
                   help="keep tokens at least this fraction as likely as the most likely one (default: off)")
    p.add_argument("--seed", type=seed_int, metavar="N", help="make the sampling reproducible (default: a fresh seed each run)")
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
    add_threads_flag(p)
    p.set_defaults(func=cmd_sample, parser=p)

    p = sub.add_parser("next-token", help="show the most likely next tokens after a prompt",
                       description="Print the model's top candidates for the token after --prompt, with their "
                       "probabilities at --temperature, or side by side at several --temperatures.")
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder written by `tinylm train`")
    p.add_argument("--checkpoint", choices=["best", "latest"], default="best", help="which checkpoint (default: best)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--top", type=positive_int, default=10, metavar="N", help="how many candidates (default: 10)")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="T",
                   help="the temperature of the probabilities (default: 1.0)")
    p.add_argument("--temperatures", metavar="T1,T2,...",
                   help="show the probabilities at several temperatures side by side, e.g. 0.5,1,2")
    add_threads_flag(p)
    p.set_defaults(func=cmd_next_token, parser=p)
