"""tinylm's own models, exported: transformers and llama.cpp continue a plain-text prompt as `tinylm sample` does.

A tinylm model reads every document after its separator token, and `tinylm sample` puts that token before
the prompt; the exports declare it as the BOS their tokenizer adds, so a user who gives transformers
(``AutoTokenizer(prompt)`` + ``generate``) or llama.cpp (a completion of the prompt text) plain text gets the
same greedy text, with nothing put first by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from exportkit import make_tokenizer, tiny_model
from runkit import write_model_run

from tinylm.cli import main
from tinylm.export import export_run

import transformers

PROMPT = "ROMEO.\n    def wrap(text"
N = 16


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as `tinylm train` writes it (packed documents: the separator starts a prompt)."""
    return write_model_run(tmp_path_factory.mktemp("run"), tiny_model("llama-gqa"), make_tokenizer())


@pytest.fixture
def sampled(run_dir, capsys) -> str:
    """What `tinylm sample --temperature 0` prints for the prompt: the prompt and its continuation."""
    capsys.readouterr()
    assert main(["sample", "--run", str(run_dir), "--prompt", PROMPT, "--temperature", "0",
                 "--max-new-tokens", str(N)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(PROMPT) and len(printed) > len(PROMPT) + 4
    return printed.removesuffix("\n")


def test_transformers_continues_the_hf_export_as_tinylm_sample_does(run_dir, sampled, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_run(run_dir, tmp_path / "hf", "hf")
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = tok(PROMPT, return_tensors="pt")  # plain text; the tokenizer adds what it declares
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=N, do_sample=False)
    assert tok.decode(generated[0], skip_special_tokens=True) == sampled


def test_llama_cpp_continues_the_gguf_export_as_tinylm_sample_does(run_dir, sampled, tmp_path):
    import llama_cpp
    out = export_run(run_dir, tmp_path / "m.gguf", "gguf")
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_threads=1, verbose=False)
    # what tinylm never samples (BOS, PAD, reserved ids) the HF export's generation config names for transformers;
    # llama.cpp is told the same with a logit bias
    export_run(run_dir, tmp_path / "hf", "hf")
    never = json.loads((tmp_path / "hf" / "generation_config.json").read_text())["suppress_tokens"]
    prompt = llm.tokenize(PROMPT.encode("utf-8"), add_bos=True, special=False)  # BOS only where the file says

    def leave_out(_, scores):
        scores[never] = -float("inf")
        return scores

    made = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, logits_processor=leave_out):
        if token == llm.token_eos() or len(made) == N:
            break
        made.append(token)
    # llama-cpp-python's completion text drops bytes that do not decode; tinylm prints U+FFFD for them
    assert llm.detokenize(prompt + made).decode("utf-8", errors="replace") == sampled
