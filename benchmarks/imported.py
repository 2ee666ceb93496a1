"""Benchmark: models and tokenizers made elsewhere, imported into tinylm, next to the tools that made them.

Run from the repository root (needs the test extras: transformers, tokenizers, llama-cpp-python)::

    python benchmarks/imported.py                      # both parts
    python benchmarks/imported.py --only tokenizers --vocab-size 32768 --repeats 5
    python benchmarks/imported.py --only models

**tokenizers**: for each layout in `tests/hfkit.py` (GPT-2, GPT-2 with add_prefix_space, SmolLM, Llama 3,
Qwen2, SentencePiece-style with byte fallback in two spellings) a tokenizer is trained by Hugging Face
`tokenizers` on Shakespeare at ``--vocab-size`` and saved by `transformers`; tinylm imports the folder.
Both encode every document of the corpus, one at a time on one thread (the median of ``--repeats``
passes, the two taking turns), and the ids must be equal on all of it. Printed: MB of UTF-8 per second
for each and tinylm's speed as a multiple of theirs.

**models**: for each family (GPT-2, Llama 3 with GQA and llama3 RoPE scaling, SmolLM-style Llama, Qwen2
with a padded output layer, Mistral with a sliding window, TinyLlama-style Llama) a tiny random checkpoint
by `transformers` with its family's tokenizer is imported; printed are the largest |logit| difference
from transformers on a 96-token text, whether 32 greedy tokens from tinylm's KV cache equal
transformers' ``generate``, the largest difference after exporting back to Hugging Face, and (where
llama.cpp runs the family) the largest difference of llama.cpp's scores on the GGUF export and whether
its greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hfkit import STYLES, build  # noqa: E402
from timing import alternating  # noqa: E402

from tinylm.data import load_corpus  # noqa: E402
from tinylm.tokenizers.files import import_tokenizer  # noqa: E402

TEXT = ("ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Grüße 東京 😀\n\tdef f(x):  return x * 2  # 1234567")


def bench_tokenizers(vocab_size: int, repeats: int) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    docs = list(load_corpus("shakespeare").texts())
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"tokenizers: Shakespeare, {len(docs)} documents, {n_bytes / 1e6:.2f} MB, vocab {vocab_size}, "
          f"one document at a time, median of {repeats}")
    print(f"{'layout':<26}{'tinylm kind':<15}{'tinylm MB/s':>12}{'HF MB/s':>10}{'tinylm / HF':>13}  same ids")
    with tempfile.TemporaryDirectory() as tmp:
        for style in STYLES:
            folder = build(style, Path(tmp) / style, vocab_size=vocab_size, texts=docs)
            ours = import_tokenizer(folder)
            theirs = AutoTokenizer.from_pretrained(str(folder))._tokenizer  # the `tokenizers` object itself
            timed = alternating({"ours": lambda: [ours.encode(d) for d in docs],
                                 "theirs": lambda: [theirs.encode(d, add_special_tokens=False).ids for d in docs]},
                                repeats)
            (ours_s, a), (theirs_s, b) = timed["ours"], timed["theirs"]
            print(f"{style:<26}{ours.kind:<15}{n_bytes / 1e6 / ours_s:>12.2f}{n_bytes / 1e6 / theirs_s:>10.2f}"
                  f"{theirs_s / ours_s:>12.2f}x  {a == b}")


def bench_models() -> None:
    import llama_cpp
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinylm.export import export_gguf, export_hf, import_hf_into_run
    from tinylm.generate.engine import Engine
    from tinylm.generate.sampling import SamplingParams
    from tinylm.run import load_run

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256)
    families = {
        "gpt2": ("gpt2", lambda v, t: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=256))),
        "llama3 (GQA, llama3 RoPE)": ("llama3", lambda v, t: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=v, num_key_value_heads=2, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, **shape))),
        "smollm (MQA, tied)": ("smollm", lambda v, t: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=v, num_key_value_heads=1, tie_word_embeddings=True, **shape))),
        "qwen2 (qkv bias, padded)": ("qwen2", lambda v, t: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=v + 36, num_key_value_heads=2, **shape))),
        "mistral (window 16)": ("sentencepiece", lambda v, t: transformers.MistralForCausalLM(
            transformers.MistralConfig(vocab_size=v, num_key_value_heads=2, sliding_window=16, **shape))),
        "tinyllama": ("sentencepiece-metaspace", lambda v, t: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=v, num_key_value_heads=4, **shape))),
    }
    transformers.utils.logging.disable_progress_bar()
    print("models: tiny random checkpoints by transformers, float32; max |logit difference| and greedy agreement")
    print(f"{'family':<28}{'import':>10}{'greedy=':>9}{'HF back':>10}{'llama.cpp':>11}{'greedy=':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (style, make) in families.items():
            root = Path(tmp) / style
            folder = build(style, root / "hf")
            hf_tok = AutoTokenizer.from_pretrained(str(folder))
            torch.manual_seed(0)
            hf = make(len(hf_tok), hf_tok)
            with torch.no_grad():
                for p in hf.parameters():
                    p.normal_(0, 0.2)
            hf.eval().save_pretrained(folder)
            run = load_run(import_hf_into_run(folder, root / "run"))
            ids = hf_tok(TEXT * 2)["input_ids"][:96]
            x = torch.tensor([ids])
            with torch.no_grad():
                theirs = hf(x).logits
                diff = (run.model(x)[0] - theirs).abs().max().item()
                greedy_hf = hf.generate(x, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                                        attention_mask=torch.ones_like(x))[0].tolist()
            [done] = Engine(run.model, SamplingParams(max_new_tokens=32, temperature=0, stop_ids=[])).generate([ids])
            same = ids + done.token_ids == greedy_hf
            export_hf(run.model, run.tokenizer, root / "back")
            with torch.no_grad():
                back = (AutoModelForCausalLM.from_pretrained(root / "back")(x).logits - theirs).abs().max().item()
            cpp, cpp_same = "refused", ""
            try:
                export_gguf(run.model, run.tokenizer, root / "m.gguf")
            except Exception:  # noqa: BLE001 (a family llama.cpp cannot run is refused in one line)
                cpp = "refused"
            else:
                llm = llama_cpp.Llama(model_path=str(root / "m.gguf"), n_ctx=256, logits_all=True, n_threads=1,
                                      type_k=0, type_v=0, verbose=False)
                llm.eval(ids)
                cpp = f"{np.abs(np.array(llm.scores[:len(ids)]) - theirs[0].numpy()).max():.1e}"
                tokens = list(ids)
                for _ in range(32):
                    tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval([tokens[-1]])
                cpp_same = str(tokens == ids + done.token_ids)
            print(f"{name:<28}{diff:>10.1e}{same!s:>9}{back:>10.1e}{cpp:>11}{cpp_same:>9}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["tokenizers", "models"], help="run one part (default: both)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the tokenizers' vocabulary (default 8192)")
    parser.add_argument("--repeats", type=int, default=3, help="encoding passes; the median is reported (default 3)")
    args = parser.parse_args(argv)
    if args.only in (None, "tokenizers"):
        bench_tokenizers(args.vocab_size, args.repeats)
    if args.only in (None, "models"):
        bench_models()


if __name__ == "__main__":
    main()
