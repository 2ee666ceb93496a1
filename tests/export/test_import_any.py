"""Models people already have: a `transformers` checkpoint with the tokenizer its family uses, imported whole.

Each family is a tiny random checkpoint saved by `transformers` next to a tokenizer trained by Hugging Face
`tokenizers` in that family's layout (`hfkit`): GPT-2 with GPT-2's byte-level BPE (one special at id 0, the
bytes in the trainer's order), Llama 3 (GQA, llama3 RoPE scaling) with a Llama-3-style tokenizer (its
specials after the merges, BOS in front), Qwen2 (q/k/v biases, an output layer padded past the tokenizer)
with an NFC-normalizing one, Mistral (MQA, a sliding window, untied head) and a TinyLlama-style Llama with
SentencePiece-style tokenizers (byte fallback), Gemma 2 and Gemma 3 with Gemma's (no space put in front, "<bos>"
added) and Phi-3 with Llama 2's. Every id stays the model's, so:

- the run's tokenizer gives transformers' ids, and the model transformers' logits (within 1e-4) on them;
- tinylm's cached greedy decoding gives transformers' ``generate`` tokens;
- exported back to Hugging Face, the checkpoint and its tokenizer give the same logits and ids again;
- as GGUF, llama.cpp gives the same greedy tokens (and the same ids for the text where it tokenizes);
- the commands a user runs on a run (sample, next-token, eval --corpus, train --init-from) work on it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from exportkit import randomize
from hfkit import PROBE_TEXT, build

from tinylm.export import export_gguf, export_hf, import_hf_into_run
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.run import load_run

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ATOL = 1e-4
TEXT = "To be, or not to be: that is the question. Grüße, 東京 😀\n\tdef f(x):  return x"
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)


def _gpt2(vocab: int, hf_tok):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=128,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id))


def _llama3(vocab: int, hf_tok):
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, num_key_value_heads=2, rope_parameters=rope, tie_word_embeddings=True,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, **SHAPE))


def _smollm(vocab: int, hf_tok):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, num_key_value_heads=1, tie_word_embeddings=True,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, **SHAPE))


def _qwen2(vocab: int, hf_tok):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=vocab + 36, num_key_value_heads=2, tie_word_embeddings=True,  # rows past the tokenizer
        eos_token_id=hf_tok.eos_token_id, **SHAPE))


def _mistral(vocab: int, hf_tok):
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=vocab, num_key_value_heads=1, sliding_window=16, tie_word_embeddings=False,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, **SHAPE))


def _tinyllama(vocab: int, hf_tok):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, num_key_value_heads=4, tie_word_embeddings=False,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, **SHAPE))


def _gemma2(vocab: int, hf_tok):  # a window of 16 on layer 0, layer 1 whole; Gemma 2's caps; head tied (llama.cpp's)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=vocab, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=16,
        bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id, **SHAPE))


def _gemma3(vocab: int, hf_tok):  # QK-norm, both layers windowed (llama.cpp's pattern), untied
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=vocab, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=16,
        tie_word_embeddings=False, bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id, **SHAPE))


def _phi3(vocab: int, hf_tok):
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=vocab, num_key_value_heads=2, bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.eos_token_id, **SHAPE))


# family -> (tokenizer style, model maker, whether llama.cpp can run it with its own tokenizer too)
FAMILIES = {
    "gpt2": ("gpt2", _gpt2),
    "smollm": ("smollm", _smollm),
    "llama3": ("llama3", _llama3),
    "qwen2": ("qwen2", _qwen2),
    "mistral": ("sentencepiece", _mistral),
    "tinyllama": ("sentencepiece-metaspace", _tinyllama),
    "gemma2": ("gemma", _gemma2),
    "gemma3": ("gemma", _gemma3),
    "phi3": ("sentencepiece", _phi3),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers tokenizer, transformers model, its folder, the imported run)."""
    style, make = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = build(style, root / "hf")
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    hf = randomize(make(len(hf_tok), hf_tok)).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    run = load_run(import_hf_into_run(folder, root / "run"))
    return request.param, hf_tok, hf, folder, run


def hf_ids(hf_tok, text: str) -> list[int]:
    return hf_tok(text)["input_ids"]  # with the family's own BOS, where its pipeline puts one


def test_same_ids_and_logits_as_transformers(family):
    name, hf_tok, hf, _, run = family
    assert run.tokenizer.encode(PROBE_TEXT) == hf_tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    ids = hf_ids(hf_tok, TEXT)
    assert ids == run.start_ids + run.tokenizer.encode(TEXT) if run.tokenizer.add_bos else \
        ids == run.tokenizer.encode(TEXT)
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf(x).logits
        ours = run.model(x)[0]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < ATOL


def test_same_greedy_tokens_as_transformers_generate(family):
    name, hf_tok, hf, _, run = family
    ids = hf_ids(hf_tok, TEXT)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0].tolist()
    [completion] = Engine(run.model, SamplingParams(max_new_tokens=24, temperature=0, stop_ids=[])).generate([ids])
    assert ids + completion.token_ids == theirs


def test_export_back_to_hugging_face_gives_the_same_logits_and_ids(family, tmp_path):
    name, hf_tok, hf, _, run = family
    export_hf(run.model, run.tokenizer, tmp_path / "back")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    back_tok = AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert type(back).__name__ == type(hf).__name__
    ids = hf_ids(hf_tok, TEXT)
    assert back_tok(TEXT)["input_ids"] == ids and back_tok(PROBE_TEXT)["input_ids"] == hf_ids(hf_tok, PROBE_TEXT)
    assert back_tok.decode(ids) == hf_tok.decode(ids)
    with torch.no_grad():
        assert (back(torch.tensor([ids])).logits - hf(torch.tensor([ids])).logits).abs().max().item() < ATOL
    # generation stops where tinylm's does: eos, and the end of a turn (Llama 3's chat template ends with <|eot_id|>)
    tok = run.tokenizer
    stops = [tok.eos_id] + [i for i in tok.stop_ids if i != tok.eos_id]
    assert (name == "llama3") == (tok.special_tokens.get("<|eot_id|>") in stops)
    assert back.generation_config.eos_token_id == (stops if len(stops) > 1 else stops[0])


def test_llama_cpp_runs_the_gguf_export_with_the_same_greedy_tokens(family, tmp_path):
    import llama_cpp
    name, hf_tok, hf, _, run = family
    if name == "mistral":  # llama.cpp's llama graph has no window: a model whose window matters is refused
        from tinylm.errors import TinyLMError

        with pytest.raises(TinyLMError, match="window"):
            export_gguf(run.model, run.tokenizer, tmp_path / "m.gguf")
        return
    export_gguf(run.model, run.tokenizer, tmp_path / "m.gguf")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=128, logits_all=True, n_threads=1,
                          type_k=0, type_v=0, verbose=False)
    ids = hf_ids(hf_tok, TEXT)
    # llama.cpp's own tokenizer, from the file: the same ids for ordinary text (its BOS rule included)
    plain = "To be, or not to be: that is the question."
    assert llm.tokenize(plain.encode(), add_bos=run.tokenizer.add_bos, special=False) == hf_ids(hf_tok, plain)
    eot = [i for i in run.tokenizer.stop_ids if i != run.tokenizer.eos_id]
    assert int(llm.metadata.get("tokenizer.ggml.eot_token_id", -1)) == (eot[0] if eot else -1)
    llm.eval(ids)
    tokens = list(ids)
    for _ in range(16):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    [completion] = Engine(run.model, SamplingParams(max_new_tokens=16, temperature=0, stop_ids=[])).generate([ids])
    assert tokens == ids + completion.token_ids


def tinylm(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_the_commands_work_on_an_imported_run(name, tmp_path):
    """import, sample, next-token, eval --corpus, train --init-from and export, as a user types them."""
    style, make = FAMILIES[name]
    folder = build(style, tmp_path / "hf")
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    randomize(make(len(hf_tok), hf_tok)).save_pretrained(folder, safe_serialization=True)
    done = tinylm("import", "--from", "hf", "--out", "run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = load_run(tmp_path / "run")

    sample = tinylm("sample", "--run", "run", "--prompt", "def f", "--max-new-tokens", "8", "--temperature", "0",
                    cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr
    ids = run.start_ids + run.tokenizer.encode("def f")
    [completion] = Engine(run.model, SamplingParams(max_new_tokens=8, temperature=0)).generate([ids])
    assert sample.stdout == "def f" + run.tokenizer.decode(completion.token_ids) + "\n"

    nxt = tinylm("next-token", "--run", "run", "--prompt", "def f", "--top", "3", cwd=tmp_path)
    assert nxt.returncode == 0, nxt.stderr
    with torch.no_grad():
        best = int(run.model(torch.tensor([ids]))[0][0, -1].argmax())
    first = nxt.stdout.splitlines()[1].split()
    assert first[:2] == ["1", str(best)]

    corpus = tmp_path / "text.txt"
    corpus.write_text(PROBE_TEXT * 4)
    ev = tinylm("eval", "--run", "run", "--corpus", str(corpus), "--json", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    assert 0 < json.loads(ev.stdout)["bits_per_byte"] < 40

    tuned = tinylm("train", "--init-from", "run", "--out", "tuned", "--corpus", str(corpus), "--max-steps", "2",
                   "--batch-size", "2", "--eval-tokens", "64", "--final-eval-tokens", "64", "--sample-tokens", "0",
                   "--threads", "1", "--no-progress", "--val-fraction", "0.5", cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr
    assert load_run(tmp_path / "tuned").tokenizer.fingerprint() == run.tokenizer.fingerprint()

    out = tinylm("export", "--run", "tuned", "--format", "hf", "--out", "back", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert AutoTokenizer.from_pretrained(str(tmp_path / "back"))(TEXT)["input_ids"] == hf_tok(TEXT)["input_ids"]


# ----- greedy text end to end: what a user types, against what transformers prints -------------------------------

PROMPT = "def wrap(text, width=70):\n    return"


def hf_greedy_text(hf, hf_tok, ids: list[int], n: int, *, whole: bool = True) -> str:
    """transformers' greedy continuation of ``ids``, decoded with them (``whole``) or alone; it ends at the first
    special token (eos, or the end of a turn), where tinylm's sampler stops too."""
    specials = sorted(i for i, t in hf_tok.added_tokens_decoder.items() if t.special)
    beyond = list(range(len(hf_tok), hf.config.vocab_size))  # a padded output layer's rows: ids of no token
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=specials,
                          pad_token_id=specials[0], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          suppress_tokens=beyond or None)
    return hf_tok.decode(out[0, 0 if whole else len(ids):].tolist(), skip_special_tokens=True)


def tinylm_sample(run_dir, prompt: str, n: int, capsys) -> str:
    from tinylm.cli import main

    capsys.readouterr()
    assert main(["sample", "--run", str(run_dir), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", str(n)]) == 0
    return capsys.readouterr().out


def test_sample_prints_what_transformers_generate_gives_on_the_prompt(family, capsys):
    """`tinylm sample --temperature 0` on plain text: the ids its tokenizer makes with its default special tokens
    (BOS where the post-processor adds it, nothing where it does not), and their greedy continuation."""
    name, hf_tok, hf, _, run = family
    expected = hf_greedy_text(hf, hf_tok, hf_tok(PROMPT)["input_ids"], 12) + "\n"
    assert tinylm_sample(run.path, PROMPT, 12, capsys) == expected


def test_chat_endpoint_replies_what_generate_gives_on_the_chat_template(family):
    from fastapi.testclient import TestClient

    from tinylm.serve.app import create_app

    name, hf_tok, hf, _, run = family
    if not hf_tok.chat_template:  # GPT-2's: the server writes a transcript, which transformers has no say on
        assert run.tokenizer.chat_template is None
        return
    messages = [{"role": "user", "content": "Wrap this text, please."}]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = hf_greedy_text(hf, hf_tok, list(ids), 10, whole=False).lstrip()
    with TestClient(create_app(run)) as client:
        reply = client.post("/v1/chat/completions", json={"model": run.path.name, "messages": messages, "max_tokens": 10,
                                                          "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize("style,make", [("llama3", _llama3), ("sentencepiece", _mistral)])
def test_a_tokenizer_that_adds_no_bos_gives_a_prompt_without_one(style, make, tmp_path, capsys):
    """Llama-3-style and Mistral-style files whose post-processor adds nothing: the run's prompt has no start
    token either, so `tinylm sample` continues what transformers continues."""
    folder = build(style, tmp_path / "hf")
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    hf = randomize(make(len(hf_tok), hf_tok)).eval()
    hf.save_pretrained(folder, safe_serialization=True)
    run_dir = import_hf_into_run(folder, tmp_path / "run")
    ids = hf_tok(PROMPT)["input_ids"]
    assert ids[0] != hf_tok.bos_token_id and load_run(run_dir).start_ids == []
    assert tinylm_sample(run_dir, PROMPT, 12, capsys) == hf_greedy_text(hf, hf_tok, ids, 12) + "\n"
