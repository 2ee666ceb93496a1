"""`tinylm export` and `tinylm import`: runs to and from Hugging Face folders, GGUF files and PEFT adapters."""

from __future__ import annotations

import argparse

from tinylm.cli.flags import add_command, add_role_flags, add_run_flags, roles_from
from tinylm.errors import TinyLMError


def cmd_export(args: argparse.Namespace) -> int:
    """Export a trained run: a Hugging Face folder (config.json, model.safetensors, tokenizer.json) in the GPT-2,
    Llama, Qwen2, Qwen3 or Mistral layout, a GGUF file for llama.cpp, or a LoRA run's adapter as a PEFT adapter
    folder (adapter_config.json, adapter_model.safetensors). A configuration no architecture can express is refused
    with what does not map."""
    from tinylm.export import export_run

    extra = {"dtype": args.dtype} if args.dtype else {}
    if args.dtype and args.format != "gguf":
        raise TinyLMError("--quant/--dtype applies to --format gguf only; Hugging Face export writes float32")
    path = export_run(args.run, args.out, args.format, checkpoint=args.checkpoint, overwrite=args.force, **extra)
    print(f"exported {args.run} ({args.checkpoint} checkpoint) as {args.format}: {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Import a local transformers checkpoint (config.json, model.safetensors, and its tokenizer: tokenizer.json or
    vocab.json + merges.txt, with tokenizer_config.json) as a run folder that sample, eval, serve and train
    --init-from can use. Token ids stay the model's. A PEFT LoRA adapter (adapter_config.json) with the model it
    adapts (--base) becomes a LoRA run."""
    from tinylm.export import import_hf_into_run, import_peft_into_run, is_peft_adapter

    if is_peft_adapter(args.source):
        if not args.base:
            raise TinyLMError(f"{args.source} is a PEFT adapter (it has adapter_config.json): give the model it adapts "
                              "with --base (a tinylm run, a checkpoint folder or a Hugging Face model folder)")
        run = import_peft_into_run(args.source, args.base, args.out, force=args.force, roles=roles_from(args))
        print(f"imported the adapter {args.source} on {args.base} into the LoRA run {run}; sample, eval, serve or "
              "export it as any run")
        return 0
    if args.base:
        raise TinyLMError(f"--base names the model a PEFT adapter adapts, and {args.source} is not an adapter (no "
                          "adapter_config.json); import a model without --base")
    run = import_hf_into_run(args.source, args.out, force=args.force, roles=roles_from(args))
    print(f"imported {args.source} into the run {run}; sample, eval, serve or fine-tune it with --init-from {run}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """tinylm export and tinylm import."""
    p = add_command(sub, "export", cmd_export,
                    "write a trained run for transformers (hf) or llama.cpp (gguf), or a LoRA run's adapter for PEFT")
    add_run_flags(p, "the run folder")
    p.add_argument("--format", required=True, choices=["hf", "gguf", "peft"],
                   help="hf, gguf (a LoRA run merged into its base) or peft (a LoRA run's adapter alone)")
    p.add_argument("--out", required=True, help="output folder (hf, peft) or .gguf file")
    # one option under two names: --dtype came first, --quant is what llama.cpp users look for
    p.add_argument("--quant", "--dtype", dest="dtype", choices=["f32", "f16", "q8_0"],
                   help="gguf matrix type: f32 (default, exact), f16 or q8_0 (8-bit blocks of 32); vectors stay f32")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")

    p = add_command(sub, "import", cmd_import,
                    "turn a local Hugging Face GPT-2, Llama, Qwen2/3 or Mistral checkpoint (or a PEFT adapter on "
                    "its --base) into a tinylm run")
    p.add_argument("--from", dest="source", required=True,
                   help="the Hugging Face model folder, or a PEFT adapter folder")
    p.add_argument("--base", metavar="MODEL",
                   help="with a PEFT adapter: the model it adapts (a tinylm run, checkpoint or Hugging Face folder)")
    p.add_argument("--out", required=True, help="the run folder to create")
    add_role_flags(p)
    p.add_argument("--force", action="store_true", help="replace --out if it is an existing tinylm run")
