"""`tinylm serve`: a trained run behind the OpenAI API and the playground page.

The flags are parsed here; where the API key comes from and which values are refused is
`tinylm.serve.options`' policy, shared with `serve()` and `create_app()`, and the serving itself is
`tinylm.serve.server.serve`.
"""

from __future__ import annotations

import argparse

from tinylm.cli.flags import RUN_HELP, add_command, add_run_flags, add_threads_flag, nonneg_float, port, positive_int
from tinylm.cli.generate import add_quant_flag


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a trained run over HTTP: the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions, streaming
    by server-sent events) that the official openai clients use unchanged, and a playground page at / that streams
    completions and charts the next-token probabilities. Requests in flight are decoded together in batches.

    --adapter NAME=DIR (repeatable) serves a LoRA adapter of the run's model beside it, as the model NAME: the base
    is loaded once, and requests for the base and any adapters decode in one batch. Without --run, the adapters'
    own base is served."""
    # the flags are checked before the run is loaded, so a bad value is refused at once
    from tinylm.serve import server
    from tinylm.serve.options import api_key_or_env, check_options

    if args.run is None and not args.adapter:
        args.parser.error("the following arguments are required: --run (or --adapter NAME=DIR, whose base is served)")
    api_key = api_key_or_env(args.api_key)
    check_options(model_name=args.model_name, body_timeout=args.body_timeout, allow_origins=args.allow_origin or ())
    server.serve(args.run, host=args.host, port=args.port, api_key=api_key, model_name=args.model_name,
                 max_batch_size=args.max_batch_size, batch_window=args.batch_window_ms / 1000,
                 checkpoint=args.checkpoint, device=args.device, log_level=args.log_level,
                 allow_origins=args.allow_origin or (), draft=args.draft, draft_k=args.draft_k,
                 body_timeout=args.body_timeout, threads=args.threads, adapters=args.adapter or (),
                 quant=args.quant, prefix_cache_mb=args.prefix_cache_mb)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm serve."""
    p = add_command(sub, "serve", cmd_serve, "serve a trained run: an OpenAI-compatible API and a web playground")
    add_run_flags(p, RUN_HELP + "; with --adapter, the adapters' base (its run or checkpoint folder; default: "
                  "the base they name)", required=False)
    p.add_argument("--adapter", action="append", metavar="NAME=DIR",
                   help="also serve the LoRA adapter in DIR (a run of finetune/train --lora-rank, or its checkpoint) "
                   "as the model NAME, sharing the base's weights; repeat for several (default: none)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every network)")
    p.add_argument("--port", type=port, default=8000, help="the port (default: 8000; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API (default: $TINYLM_API_KEY, else no key)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients ask for (default: the run folder's name)")
    p.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="let web pages from this origin (e.g. http://localhost:3000, or * for any) call the API "
                   "from a browser (CORS); repeat for several (default: none)")
    p.add_argument("--max-batch-size", type=positive_int, default=32, metavar="N",
                   help="the most samples decoded together; 1 serves one at a time (default: 32)")
    p.add_argument("--batch-window-ms", type=nonneg_float, default=2.0, metavar="MS",
                   help="how long an idle server waits for more requests to batch with the first (default: 2)")
    p.add_argument("--body-timeout", type=float, metavar="SECONDS",
                   help="how long a request's body may take to arrive; a client slower than that gets 408 and "
                   "its connection closed (default: 30)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default: cpu)")
    add_threads_flag(p)
    add_quant_flag(p)
    p.add_argument("--draft", metavar="ngram|prompt|DIR",
                   help="speculative decoding of a lone request (as tinylm sample --draft): the same greedy text, "
                   "the same sampling distribution, faster where drafts are often kept (default: off)")
    p.add_argument("--draft-k", type=positive_int, default=4, metavar="N",
                   help="the most tokens drafted per model pass (default: 4)")
    p.add_argument("--prefix-cache-mb", type=nonneg_float, default=256, metavar="MB",
                   help="memory for the keys and values of earlier requests: a request whose prompt starts with "
                   "the tokens of an earlier prompt and reply (a chat's next turn) runs the model on the rest only; "
                   "0 turns it off (default: 256)"),
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="the server's log level; info logs every request (default: info)")
