"""Chat templates: a model tuned on conversations reads its messages as `transformers` writes them, and ends its turn.

The oracles: `transformers`' ``apply_chat_template`` on the same tokenizer folder (text and ids),
`transformers`' ``generate`` on the same checkpoint (where a greedy reply stops), and the official
`openai` client against the real `tinylm serve` command.

The folders are made by `hfkit` (Llama 3's, ChatML's and Llama 2's templates). The end-to-end model
is a tiny `LlamaForCausalLM` written by ``save_pretrained`` and imported as a run: its attention and
MLP outputs are zero, so each next token depends on the current one alone, and its head is set to
spell a short reply after the generation prompt and then ``<|eot_id|>`` (a chain of bigrams), so a
server that did not stop at the end of the turn would go on writing.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from hfkit import build
from servekit import CommandServer, ThreadServer

from tinylm.config import GPTConfig
from tinylm.export import import_hf_into_run
from tinylm.generate.engine import Engine
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.run import load_run
from tinylm.serve.chat import STOP, ChatFormat
from tinylm.tokenizers import CharTokenizer
from tinylm.tokenizers.chat_template import ChatTemplateError, render_chat, special_token_variables
from tinylm.tokenizers.hf_files import read_hf_tokenizer

import transformers

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "What is a token?"},
     {"role": "assistant", "content": " A piece of text. "}, {"role": "user", "content": "And a KV cache?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Grüße aus Köln, "},
                                  {"type": "text", "text": "東京 😀"}]}],
    [{"role": "user", "content": "naïve café — «quotes»\n\ttabs"},
     {"role": "assistant", "content": "Très bien 👍"},
     {"role": "user", "content": [{"type": "text", "text": "Ещё раз?"}]}],
]
REPLY = "Hello world!"


def joined(messages):
    """The messages as transformers is given them: content parts joined to one string (as tinylm does first)."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else
             "".join(part["text"] for part in m["content"])} for m in messages]


def template_ids(hf_tokenizer, messages) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])  # transformers 5 may give a BatchEncoding


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-templates")
    return {style: build(style, root / style) for style in ("llama3", "qwen2", "sentencepiece")}


@pytest.mark.parametrize("style", ["llama3", "qwen2", "sentencepiece"])
def test_prompts_are_apply_chat_templates_text_and_ids(folders, style):
    tok = read_hf_tokenizer(folders[style])
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[style]))
    chat = ChatFormat(tok, start_ids=[tok.bos_id])  # the start ids are not used: the template writes BOS itself
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(joined(messages), add_generation_prompt=True, tokenize=False)
        assert render_chat(tok.chat_template, joined(messages), special_token_variables(tok)) == expected
        assert chat.prompt_ids(messages) == template_ids(hf, joined(messages))
    assert chat.stop == ()  # no transcript stop strings: the model ends its turn with a token


def test_a_tokenizer_without_a_template_keeps_the_transcript():
    tok = CharTokenizer.train("System: User: Assistant: Hi there, what is a token?\n")
    chat = ChatFormat(tok, start_ids=[tok.eos_id])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert chat.template is None and chat.stop == STOP
    assert chat.prompt_ids(messages) == [tok.eos_id] + tok.encode("User: Hi there\nAssistant:")


def test_a_template_that_refuses_is_one_line_and_so_is_one_that_does_not_compile(folders):
    tok = read_hf_tokenizer(folders["sentencepiece"])
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('Conversation roles must alternate\nuser/assistant/user/assistant/...') }}"
                         "{% endif %}{{ m['content'] }}{% endfor %}")
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="^the model's chat template refused these messages: Conversation "
                                                "roles must alternate user/assistant/user/assistant/...$"):
        ChatFormat(tok, [tok.bos_id]).prompt_ids(twice)
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["sentencepiece"]))
    with pytest.raises(Exception, match="Conversation roles must alternate"):  # what transformers says too
        hf.apply_chat_template(twice, chat_template=tok.chat_template, tokenize=False)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }"
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        ChatFormat(tok, [tok.bos_id]).prompt_ids(twice)


def test_the_sandbox_keeps_a_template_from_pythons_internals(folders):
    tok = read_hf_tokenizer(folders["qwen2"])
    variables = special_token_variables(tok)
    for template in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__subclasses__() }}",
                     "{% set ns = namespace() %}{% set ns._x = 1 %}", "{{ messages.append(1) }}"):
        with pytest.raises(ChatTemplateError, match="refused"):
            render_chat(template, [{"role": "user", "content": "x"}], variables)
    # tojson as transformers' writes it: non-ASCII as is, an indent on request
    assert render_chat("{{ messages[0] | tojson(indent=1) }}", [{"role": "user", "content": "é"}], variables) == \
        json.dumps({"role": "user", "content": "é"}, ensure_ascii=False, indent=1)


def test_a_template_that_refuses_is_a_400_of_one_line(folders):
    tok = read_hf_tokenizer(folders["llama3"])
    tok.chat_template = "{{ raise_exception('System messages are not supported') }}"
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, d_model=16, n_head=2)
    run = SimpleNamespace(model=GPT(config).eval(), tokenizer=tok, start_ids=[tok.bos_id])
    with ThreadServer(run) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tinylm", messages=[{"role": "system", "content": "x"}])
        error = caught.value.body
        assert error["message"] == ("the model's chat template refused these messages: "
                                    "System messages are not supported")
        assert error["param"] == "messages"
        shown = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert shown.status_code == 400 and "\n" not in shown.json()["error"]["message"]


# ----- end to end: an imported Llama that ends its turn ------------------------------------------------------


def bigram_llama(tok, chain: list[int], seed: int = 0):
    """A tiny LlamaForCausalLM whose greedy next token after ``chain[i]`` is ``chain[i + 1]``, whatever came before.

    Attention and MLP write nothing to the residual stream (o_proj and down_proj are zero), so the last
    hidden state is the current token's embedding through the final RMSNorm; the head's row for
    ``chain[i + 1]`` is that normalized embedding of ``chain[i]``, scaled, and every other row is zero.
    """
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        emb = model.model.embed_tokens.weight
        normed = emb / emb.pow(2).mean(-1, keepdim=True).add(config.rms_norm_eps).sqrt()  # (V, d)
        for current, following in zip(chain, chain[1:]):
            model.lm_head.weight[following] = normed[current] * (40.0 / config.hidden_size)
    return model


@pytest.fixture(scope="module")
def llama_chat(folders, tmp_path_factory):
    """An imported Llama-3-style chat model: (run folder, HF checkpoint folder, HF tokenizer, the chain's ids)."""
    root = tmp_path_factory.mktemp("llama-chat")
    hf_dir = root / "hf"
    shutil.copytree(folders["llama3"], hf_dir)
    tok = read_hf_tokenizer(hf_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    prompt = template_ids(hf_tok, joined(CONVERSATIONS[1]))
    eot, end_of_text = tok.special_tokens["<|eot_id|>"], tok.special_tokens["<|end_of_text|>"]
    reply = tok.encode(REPLY)
    assert len(set(reply)) == len(reply) and prompt[-1] not in reply
    model = bigram_llama(tok, [prompt[-1], *reply, eot])
    model.generation_config.eos_token_id = [end_of_text, eot]  # as Llama 3 Instruct's generation_config.json
    model.generation_config.bos_token_id = tok.bos_id
    model.save_pretrained(hf_dir)
    run_dir = import_hf_into_run(hf_dir, root / "run")
    return SimpleNamespace(run_dir=run_dir, hf_dir=hf_dir, hf_model=model, hf_tok=hf_tok, prompt=prompt,
                           reply=reply, eot=eot, end_of_text=end_of_text)


def test_the_oracle_model_writes_the_reply_and_ends_its_turn(llama_chat):
    """transformers' own greedy generation on the checkpoint: the reply, then <|eot_id|>, where it stops."""
    ids = torch.tensor([llama_chat.prompt])
    out = llama_chat.hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0, len(llama_chat.prompt):].tolist()
    assert out == [*llama_chat.reply, llama_chat.eot]


def test_the_imported_tokenizer_stops_at_eos_and_the_end_of_turn(llama_chat):
    run = load_run(llama_chat.run_dir)
    assert run.tokenizer.chat_template is not None
    assert set(run.tokenizer.stop_ids) == {llama_chat.eot}  # generation_config's list, less eos itself
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    for completion in (Engine(run.model, greedy, run.tokenizer).generate([llama_chat.prompt])[0],
                       reference_generate(run.model, [llama_chat.prompt], greedy, run.tokenizer)[0]):
        assert completion.token_ids == [*llama_chat.reply, llama_chat.eot]  # `tinylm sample` stops there too
        assert completion.text == REPLY and completion.finish_reason == "stop"


def test_serve_chat_through_the_template_with_the_openai_client(llama_chat, tmp_path):
    server = CommandServer(llama_chat.run_dir, tmp_path)
    try:
        shown = httpx.post(server.base_url + "/tokenize", json={"messages": CONVERSATIONS[1]}).json()
        assert shown["tokens"] == llama_chat.prompt  # apply_chat_template's ids: BOS from the template, once

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.chat.completions.create(model=llama_chat.run_dir.name, messages=CONVERSATIONS[1],
                                                temperature=0, max_tokens=12, logprobs=True)
        choice = answer.choices[0]
        assert choice.message.content == REPLY and choice.finish_reason == "stop"
        assert answer.usage.prompt_tokens == len(llama_chat.prompt)
        assert answer.usage.completion_tokens == len(llama_chat.reply) + 1  # the reply and <|eot_id|>
        assert "".join(t.token for t in choice.logprobs.content) == REPLY  # the end-of-turn token is not listed

        streamed = client.chat.completions.create(model=llama_chat.run_dir.name, messages=CONVERSATIONS[1],
                                                  temperature=0, max_tokens=12, stream=True)
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
        assert chunks[-1].choices[0].finish_reason == "stop"

        # a completion of the same prompt ids stops at the end of the turn too (the tokenizer's stop set)
        completion = client.completions.create(model=llama_chat.run_dir.name, prompt=llama_chat.prompt,
                                               temperature=0, max_tokens=12)
        assert completion.choices[0].text == REPLY and completion.choices[0].finish_reason == "stop"
    finally:
        server.close()
