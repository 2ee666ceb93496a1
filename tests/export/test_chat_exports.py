"""A fine-tuned tinylm run's exports chat as tinylm does: the same prompt ids, the same greedy reply, the same end.

A tiny Llama-style run with the session's BPE tokenizer is fine-tuned (`tinylm.finetune.finetune`) on a reply
pattern that depends on the question ("wrap ..." is answered "wrapped it", "fill ..." is answered "filled: ok")
until its greedy replies are those words and ``<|im_end|>``. Then:

- the Hugging Face export: ``AutoTokenizer.apply_chat_template`` gives `chat_prompt_ids`'s ids, and
  ``AutoModelForCausalLM.generate`` (greedy) writes tinylm's reply and stops at ``<|im_end|>``;
- the GGUF export: llama.cpp's chat completion (the template in the file, the markers as control tokens, the end
  of turn as its eot token) writes tinylm's reply and stops there;
- the Hugging Face export imported back is the same tokenizer (chat template and markers included) and replies
  the same.

The replies are compared as token ids. tinylm's own reply is checked against what was taught, so no comparison
can pass on two empty or runaway replies.
"""

from __future__ import annotations

import json

import pytest
import torch
from exportkit import tiny_config

from tinylm.config import Config, TrainConfig, dump_toml
from tinylm.errors import TinyLMError
from tinylm.export import export_run, import_hf_into_run
from tinylm.finetune import finetune
from tinylm.generate.engine import Engine
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.run import checkpoint_path, load_run, save_checkpoint, write_run_info
from tinylm.tokenizers.base import CHAT_END, CHAT_START
from tinylm.tokenizers.chat_template import CHATML_TEMPLATE, chat_prompt_ids, render_chat, special_token_variables
from tinylm.tokenizers.formats import load_hf_tokenizer_json, save_hf_tokenizer_json, tokenizer_from_hf_json

import gguf
import transformers

REPLIES = {"wrap": "wrapped it", "fill": "filled: ok"}
OBJECTS = ("the text", "this line", "a paragraph", "my words")
MAX_REPLY = 16  # tokens; every taught reply is shorter
STEPS = 60  # fine-tuning steps of one row (about five conversations): clear winners at every token of the replies

# (conversation, the reply it was taught, or None where only the ids across tools are compared)
CONVERSATIONS = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "wrap the text"}], REPLIES["wrap"]),
    ([{"role": "user", "content": "fill this line"}], REPLIES["fill"]),
    ([{"role": "user", "content": "wrap my words"}, {"role": "assistant", "content": REPLIES["wrap"]},
      {"role": "user", "content": "fill a paragraph"}], REPLIES["fill"]),
    ([{"role": "user", "content": "fill «café» — naïve 日本 ☕"}], None),
]


def taught_chats(n: int = 48) -> list[dict]:
    """Conversations of one question and its reply; every third has a system message."""
    chats = []
    for i in range(n):
        verb = ("wrap", "fill")[i % 2]
        messages = [{"role": "user", "content": f"{verb} {OBJECTS[i // 2 % len(OBJECTS)]}"},
                    {"role": "assistant", "content": REPLIES[verb]}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Be brief."})
        chats.append({"messages": messages})
    return chats


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tokenizer):
    """A run folder fine-tuned from a fresh tiny Llama-style base run with the session's BPE tokenizer."""
    root = tmp_path_factory.mktemp("chat")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(tiny_config("llama-gqa", block_size=128))
    config = Config(model.config, TrainConfig(device="cpu", threads=1, seed=0))
    base = root / "base"
    save_checkpoint(checkpoint_path(base, "best"), model_state=model.state_dict(), optimizer_state=None,
                    rng_state={}, state={"step": 0}, config=config, tokenizer=tokenizer)
    (base / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(base, {"status": "complete"})
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in taught_chats()), encoding="utf-8")
    settings = {"max_steps": STEPS, "lr": 1e-2, "batch_size": 1, "warmup_steps": 2, "eval_interval": STEPS,
                "sample_tokens": 0}
    result = finetune(base, str(chats), root / "run", overrides=settings, data_dir=root / "data",
                      log=lambda line: None, progress=False)
    assert result.status == "complete"
    return root / "run"


def tinylm_reply(run, messages) -> list[int]:
    """tinylm's greedy reply to ``messages`` as token ids, the token that ended it included."""
    params = SamplingParams(max_new_tokens=MAX_REPLY, temperature=0.0)
    (completion,) = Engine(run.model, params, run.tokenizer).generate([chat_prompt_ids(run.tokenizer, messages)])
    return list(completion.token_ids)


@pytest.fixture(scope="module")
def replies(tuned):
    """tinylm's replies to `CONVERSATIONS`, each checked to be what was taught and to end the turn."""
    run = load_run(tuned)
    end = run.tokenizer.special_tokens[CHAT_END]
    made = []
    for messages, taught in CONVERSATIONS:
        reply = tinylm_reply(run, messages)
        assert reply[-1] == end and 1 < len(reply) < MAX_REPLY, run.tokenizer.decode(reply)
        if taught is not None:
            assert run.tokenizer.decode(reply[:-1]) == taught
        made.append(reply)
    return made


@pytest.fixture(scope="module")
def hf_folder(tuned, tmp_path_factory):
    return export_run(tuned, tmp_path_factory.mktemp("hf") / "hf", "hf")


def test_apply_chat_template_gives_tinylms_prompt_ids(tuned, hf_folder):
    run = load_run(tuned)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    assert tok.chat_template == run.tokenizer.chat_template == CHATML_TEMPLATE
    for messages, _ in CONVERSATIONS:
        ours = chat_prompt_ids(run.tokenizer, messages)
        theirs = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert theirs == ours
        assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == render_chat(
            run.tokenizer.chat_template, messages, special_token_variables(run.tokenizer))
    # the markers are special tokens of their own: never split, dropped by skip_special_tokens
    assert tok.convert_tokens_to_ids([CHAT_START, CHAT_END]) == [run.tokenizer.special_tokens[CHAT_START],
                                                                 run.tokenizer.special_tokens[CHAT_END]]
    assert {CHAT_START, CHAT_END} <= set(tok.all_special_tokens)


def test_transformers_replies_as_tinylm_does_and_stops_at_the_end_of_turn(tuned, hf_folder, replies):
    run = load_run(tuned)
    end = run.tokenizer.special_tokens[CHAT_END]
    generation = json.loads((hf_folder / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [run.tokenizer.eos_id, end]
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder)).eval()
    for (messages, taught), reply in zip(CONVERSATIONS, replies):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=MAX_REPLY, do_sample=False)
        made = out[0, prompt["input_ids"].shape[1]:].tolist()
        assert made == reply  # the same tokens, and generate stopped at <|im_end|> as tinylm did
        if taught is not None:
            assert tok.decode(made, skip_special_tokens=True) == taught


@pytest.fixture(scope="module")
def llama(tuned, tmp_path_factory):
    import llama_cpp

    path = export_run(tuned, tmp_path_factory.mktemp("gguf") / "chat.gguf", "gguf")
    return path, llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False)


def test_the_gguf_carries_the_template_the_markers_and_the_end_of_turn(tuned, llama):
    run = load_run(tuned)
    reader = gguf.GGUFReader(llama[0])
    meta = {name: field.contents() for name, field in reader.fields.items()}
    assert meta["tokenizer.chat_template"] == CHATML_TEMPLATE
    start, end = (run.tokenizer.special_tokens[name] for name in (CHAT_START, CHAT_END))
    assert meta["tokenizer.ggml.eot_token_id"] == end
    assert meta["tokenizer.ggml.eos_token_id"] == run.tokenizer.eos_id
    control = int(gguf.TokenType.CONTROL)
    assert meta["tokenizer.ggml.token_type"][start] == meta["tokenizer.ggml.token_type"][end] == control
    assert [meta["tokenizer.ggml.tokens"][i] for i in (start, end)] == [CHAT_START, CHAT_END]


def test_llama_cpp_replies_as_tinylm_does_and_stops_at_the_end_of_turn(tuned, llama, replies):
    run = load_run(tuned)
    llm = llama[1]
    end = run.tokenizer.special_tokens[CHAT_END]
    for (messages, taught), reply in zip(CONVERSATIONS, replies):
        # the chat prompt as llama.cpp reads it: the markers parsed as the control tokens they are
        text = render_chat(llm.metadata["tokenizer.chat_template"], messages, special_token_variables(run.tokenizer))
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert ids == chat_prompt_ids(run.tokenizer, messages)
        made = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            made.append(token)
            if token == end or len(made) == MAX_REPLY:
                break
        assert made == reply
        # and what a user of llama-cpp-python writes: a chat completion through the file's template
        answer = llm.create_chat_completion(messages, temperature=0.0, max_tokens=MAX_REPLY, repeat_penalty=1.0)
        assert answer["choices"][0]["finish_reason"] == "stop"  # it ended at <|im_end|>, not at max_tokens
        assert answer["usage"]["prompt_tokens"] == len(ids) and answer["usage"]["completion_tokens"] == len(reply) - 1
        assert answer["choices"][0]["message"]["content"] == run.tokenizer.decode(reply[:-1])


def test_the_hf_export_imported_back_chats_the_same(tuned, hf_folder, replies, tmp_path):
    run = load_run(tuned)
    back = load_run(import_hf_into_run(hf_folder, tmp_path / "back"))
    assert back.tokenizer.kind == "bpe"
    assert back.tokenizer.chat_tokens == (CHAT_START, CHAT_END)
    assert back.tokenizer.chat_template == run.tokenizer.chat_template
    assert back.tokenizer.fingerprint() == run.tokenizer.fingerprint()
    assert [tinylm_reply(back, messages) for messages, _ in CONVERSATIONS] == replies


def test_a_chat_tokenizers_tokenizer_json_alone_reads_back_whole(tuned, tmp_path):
    """Without tokenizer_config.json beside it the markers get ChatML's template: the one tinylm adds them with."""
    tok = load_run(tuned).tokenizer
    path = save_hf_tokenizer_json(tok, tmp_path / "tokenizer.json")
    assert load_hf_tokenizer_json(path).fingerprint() == tok.fingerprint()
    data = json.loads(path.read_text(encoding="utf-8"))
    other = CHATML_TEMPLATE.replace("message", "m")  # a template the folder gives is kept as it is
    assert tokenizer_from_hf_json(data, chat_template=other).chat_template == other
    # one marker alone, or the two swapped, is not tinylm's layout
    swapped = [{**t, "content": {CHAT_START: CHAT_END, CHAT_END: CHAT_START}.get(t["content"], t["content"])}
               for t in data["added_tokens"]]
    for added in (data["added_tokens"][:-1], swapped):
        with pytest.raises(TinyLMError, match="not tinylm's"):
            tokenizer_from_hf_json({**data, "added_tokens": added})
