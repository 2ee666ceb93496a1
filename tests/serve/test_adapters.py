"""LoRA adapters served beside their base: ``tinylm serve --run BASE --adapter NAME=DIR ...``.

The oracle: each adapter's own run, loaded as every command loads it (`load_run` merges the adapter into a
copy of the base), decoded by the library. The server must give, for each adapter's name, that model's
greedy tokens, and for the base's name the base's, also when requests for the base and two adapters are
decoded in one batch. The adapters are written here as a LoRA run is (the adapter's tensors, its base named
in state.json), with random B, so each adapted model differs from the base. On a base with an untied head,
adapters that also correct the token embedding and the head (lora_targets ``outer``, what `tinylm finetune`
trains there) are checked the same way, through the model's forward pass and through the decoding layout.
"""

from __future__ import annotations

import base64
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from servekit import CommandServer, ThreadServer, make_run

from tinylm.checkpoint import LORA_BASE, load_checkpoint, lora_base_record, save_checkpoint
from tinylm.cli import main
from tinylm.config import Config, dump_toml
from tinylm.generate import SamplingParams, generate
from tinylm.generate.fast import make_decoder
from tinylm.generate.inspect import next_token_logits
from tinylm.model import GPT
from tinylm.model.lora import LoRAEmbedding, LoRALinear, LoraSettings, adapter_state, add_lora
from tinylm.model.lora_multi import Adapter, MultiLoRA
from tinylm.run import checkpoint_path, load_run, write_run_info
from tinylm.serve.adapters import ServedAdapters, checkpoint_run, find_adapters
from tinylm.serve.chat import STOP, chat_prompt, reply_text
from tinylm.serve.server import check_base_and_adapters

PROMPTS = ["To be, or not", "Naïve café", "東京 and"]


def make_lora_run(folder, base_checkpoint, seed, rank=4, alpha=8.0, targets="all", whole_run=True, new_tokens=0):
    """A LoRA run folder (or, ``whole_run`` False, a bare checkpoint folder) adapting ``base_checkpoint``, its B
    random (as after training at a high rate), so the adapted model differs from the base; ``new_tokens``: it
    trains the rows of that many last token ids too."""
    base = load_checkpoint(base_checkpoint)
    model = add_lora(base.build_model(), LoraSettings(rank, alpha, targets=targets, new_tokens=new_tokens))
    draw = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (LoRALinear, LoRAEmbedding)):
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=draw) * 0.2)
    config = Config(base.config.model, dataclasses.replace(base.config.train, lora_rank=rank, lora_alpha=alpha,
                                                           lora_targets=targets, lora_new_tokens=new_tokens))
    where = checkpoint_path(folder, "best") if whole_run else folder
    save_checkpoint(where, model_state=adapter_state(model), optimizer_state=None, rng_state={},
                    state={"step": 1, LORA_BASE: lora_base_record(base, where)}, config=config,
                    tokenizer=base.tokenizer)
    if whole_run:
        (folder / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
        write_run_info(folder, {"status": "complete"})
    return folder


@pytest.fixture(scope="module")
def adapters(run_dir, tmp_path_factory):
    """Two adapters of the session's run: every matrix at rank 4, and three matrices at rank 2."""
    folder = tmp_path_factory.mktemp("adapters")
    best = checkpoint_path(run_dir, "best")
    return {"poems": make_lora_run(folder / "poems-lora", best, seed=1),
            "code": make_lora_run(folder / "code-lora", best, seed=2, rank=2, alpha=3.0, targets="W_q,W_v,W_2")}


@pytest.fixture(scope="module")
def models(run, adapters):
    """Each served name's model as the library loads it: the base, and each adapter merged into a copy of it."""
    return {run.path.name: run.model, **{name: load_run(folder).model for name, folder in adapters.items()}}


@pytest.fixture(scope="module")
def adapter_server(run_dir, adapters, tmp_path_factory):
    """`tinylm serve --run BASE --adapter poems=DIR --adapter code=DIR`, waiting 200 ms for requests to batch."""
    flags = [f for name, folder in adapters.items() for f in ("--adapter", f"{name}={folder}")]
    served = CommandServer(run_dir, tmp_path_factory.mktemp("adapter-logs"), *flags, "--batch-window-ms", "200")
    yield served
    served.close()


@pytest.fixture(scope="module")
def adapter_client(adapter_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=adapter_server.base_url + "/v1", api_key="-", max_retries=0, timeout=60)


def library(model, run, prompt, **settings):
    [completion] = generate(model, run.tokenizer, prompt, SamplingParams(**settings), start_ids=run.start_ids)
    return completion


def test_mixed_rows_each_read_their_own_adapter(run, adapters, models):
    """The stacked layer, through the model's own forward: each row of one batch computes what its merged model
    computes (to float rounding), and a base row exactly what the base computes."""
    model = load_run(run.path).model
    stack = MultiLoRA(model, [Adapter(a.name, a.tensors(), a.scale) for a in find_adapters(adapters)])
    idx = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    stack.choose([0, 1, 2])
    with torch.no_grad():
        mixed, _ = model(idx)
        stack.choose([0, 0, 0])
        plain, _ = model(idx)
        expected = [m(idx[b:b + 1])[0][0] for b, m in enumerate(models.values())]
    assert torch.equal(mixed[0], plain[0])
    for b in (1, 2):
        assert torch.allclose(mixed[b], expected[b], atol=1e-4)
        assert not torch.allclose(mixed[b], plain[b], atol=1e-2)  # the adapter changes the model


@pytest.fixture(scope="module")
def untied(run, tmp_path_factory):
    """(a base run whose head is not its embedding, {name: adapter}): "chat" corrects every projection and both
    tables at rank 4, "tables" only the embedding and the head at rank 2."""
    folder = tmp_path_factory.mktemp("untied")
    config = Config(dataclasses.replace(run.config.model, tie_embeddings=False), run.config.train)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = GPT(config.model)
    best = checkpoint_path(folder / "base", "best")
    save_checkpoint(best, model_state=model.state_dict(), optimizer_state=None, rng_state={}, state={"step": 0},
                    config=config, tokenizer=run.tokenizer)
    (folder / "base" / "config.toml").write_text(dump_toml(config.to_dict()), encoding="utf-8")
    write_run_info(folder / "base", {"status": "complete"})
    return folder / "base", {"chat": make_lora_run(folder / "chat-lora", best, seed=6, targets="all,outer"),
                             "tables": make_lora_run(folder / "tables-lora", best, seed=7, rank=2, alpha=3.0,
                                                     targets="outer")}


def test_embedding_and_head_adapters_read_per_row_in_the_model_and_in_the_decoding_layout(untied):
    """Each row of one batch computes its merged model's logits, through the model's forward pass and through the
    decoding layout (a prefill, then one step), mixed rows and one adapter for every row alike."""
    base_dir, adapters = untied
    merged = [load_run(base_dir).model] + [load_run(folder).model for folder in adapters.values()]
    model = load_run(base_dir).model
    make_decoder(model, batch=1, capacity=4)  # its decoding layout made before the adapters are stacked, and kept
    served = ServedAdapters(model, find_adapters(adapters))
    idx = torch.randint(0, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    nxt = torch.tensor([7, 11, 13])
    with torch.no_grad():
        expected = [m(torch.cat([idx[b:b + 1], nxt[b:b + 1, None]], 1))[0][0] for b, m in enumerate(merged)]
        for choice in ([0, 1, 2], [2, 2, 2], [1, 1, 1]):
            want = [expected[b] if k == b else
                    merged[k](torch.cat([idx[b:b + 1], nxt[b:b + 1, None]], 1))[0][0] for b, k in enumerate(choice)]
            served.stack.choose(choice)
            forward, _ = model(idx)
            decoder = make_decoder(model, batch=3, capacity=16)
            served.choose(decoder, choice)
            prefill = decoder.start(idx, torch.ones_like(idx, dtype=torch.bool), every=True)
            step = decoder.step(nxt)
            for b in range(3):
                torch.testing.assert_close(forward[b], want[b][:-1], atol=1e-4, rtol=0)
                torch.testing.assert_close(prefill[b], want[b][:-1], atol=1e-4, rtol=0)
                torch.testing.assert_close(step[b], want[b][-1], atol=1e-4, rtol=0)
        served.stack.choose([0, 0, 0])
        assert torch.equal(model(idx)[0][0], merged[0](idx[:1])[0][0])  # the base's rows: the base, exactly
    for k in (1, 2):  # the tables' corrections matter: "tables" corrects nothing else
        assert not torch.allclose(expected[k], expected[0], atol=1e-2)


def test_embedding_and_head_adapters_answer_as_their_merged_runs_on_the_server(untied, run):
    """Requests for the base and both adapters sent together: each answer is its own merged model's greedy one."""
    base_dir, adapters = untied
    models = {"base": load_run(base_dir).model, **{n: load_run(f).model for n, f in adapters.items()}}
    jobs = [(name, prompt) for name in models for prompt in PROMPTS[:2]]
    with ThreadServer(load_run(base_dir), model_name="base", adapters=adapters, batch_window=0.2) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=60)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: client.completions.create(
                model=job[0], prompt=job[1], max_tokens=16, temperature=0).choices[0].text, jobs))
        largest = httpx.get(server.base_url + "/health").json()["scheduler"]["largest_batch"]
    for (name, prompt), answer in zip(jobs, answers):
        assert answer == library(models[name], run, prompt, max_new_tokens=16, temperature=0).text, (name, prompt)
    assert len({library(m, run, PROMPTS[0], max_new_tokens=16, temperature=0).text for m in models.values()}) == 3
    assert largest >= 4  # rows of several models decoded in one batch


def test_the_models_are_the_base_and_each_adapter(adapter_client, run_dir):
    listed = adapter_client.models.list().data
    assert [m.id for m in listed] == [run_dir.name, "poems", "code"]
    assert adapter_client.models.retrieve("poems").model_extra["parent"] == run_dir.name
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-run', 'poems' and 'code'"):
        adapter_client.completions.create(model="verse", prompt="x", max_tokens=1)


def test_each_name_answers_as_its_own_model_token_for_token(adapter_client, run, models):
    for name, model in models.items():
        for prompt in PROMPTS[:2]:
            out = adapter_client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0,
                                                    logprobs=0)
            expected = library(model, run, prompt, max_new_tokens=20, temperature=0)
            assert out.model == name
            assert out.choices[0].text == expected.text, (name, prompt)
            assert out.usage.completion_tokens == len(expected.token_ids)
    texts = {name: library(m, run, PROMPTS[0], max_new_tokens=20, temperature=0).text for name, m in models.items()}
    assert len(set(texts.values())) == 3  # three different models


def test_streamed_completion_and_chat_of_an_adapter(adapter_client, run, models):
    streamed = "".join(chunk.choices[0].text for chunk in adapter_client.completions.create(
        model="code", prompt=PROMPTS[2], max_tokens=16, temperature=0, stream=True))
    assert streamed == library(models["code"], run, PROMPTS[2], max_new_tokens=16, temperature=0).text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]
    expected = reply_text(library(models["poems"], run, chat_prompt(messages), max_new_tokens=15, temperature=0,
                                  stop=STOP).text)
    whole = adapter_client.chat.completions.create(model="poems", messages=messages, max_tokens=15, temperature=0)
    assert whole.model == "poems" and whole.choices[0].message.content == expected
    chunks = adapter_client.chat.completions.create(model="poems", messages=messages, max_tokens=15, temperature=0,
                                                    stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_the_base_and_two_adapters_in_flight_at_once(adapter_server, adapter_client, run, models):
    """Nine requests sent together (three per model, one of them streamed) are decoded in one batch, and each
    answer is still its own model's."""
    jobs = [(name, prompt, i % 3 == 0) for name in models for i, prompt in enumerate(PROMPTS)]

    def ask(name, prompt, stream):
        out = adapter_client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=stream)
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(*job), jobs))
    for (name, prompt, _), answer in zip(jobs, answers):
        assert answer == library(models[name], run, prompt, max_new_tokens=24, temperature=0).text, (name, prompt)
    # 7 rows or more in one batch: at most 3 per model, so rows of all three models decoded together
    assert httpx.get(adapter_server.base_url + "/health").json()["scheduler"]["largest_batch"] >= 7


def test_next_token_reads_the_named_adapter(adapter_server, run, models):
    out = httpx.post(adapter_server.base_url + "/next_token", json={"prompt": "To be", "model": "code"}).json()
    logits = np.frombuffer(base64.b64decode(out["logits"]), dtype="<f4")
    ids = run.start_ids + run.tokenizer.encode("To be")
    expected = next_token_logits(models["code"], ids).numpy()[:len(logits)]
    finite = np.isfinite(logits)
    assert out["model"] == "code" and np.allclose(logits[finite], expected[finite], atol=1e-4)


def test_without_run_the_adapters_base_is_served(run, tmp_path):
    """An adapter whose base is a checkpoint folder outside any run (as a chat fine-tune's base with its chat
    tokens is): leaving out --run serves that base, named "base", and the adapter answers as its merged run."""
    base = tmp_path / "chats-data" / "init"
    save_checkpoint(base, model_state=run.model.state_dict(), optimizer_state=None, rng_state={}, state={"step": 0},
                    config=run.config, tokenizer=run.tokenizer)
    chat = make_lora_run(tmp_path / "chat-lora", base, seed=3)
    folder, name, found = check_base_and_adapters(None, "best", None, [f"chat={chat}"])
    assert folder == base and name == "base" and [a.name for a in found] == ["chat"]
    with ThreadServer(checkpoint_run(folder), model_name=name, adapters=found) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base", "chat"]
        out = client.completions.create(model="chat", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.choices[0].text == library(load_run(chat).model, run, PROMPTS[0], max_new_tokens=12,
                                          temperature=0).text


def test_without_run_a_base_in_a_run_is_named_after_it(run_dir, adapters):
    folder, name, found = check_base_and_adapters(None, "best", None, {"poems": adapters["poems"]})
    assert folder == checkpoint_path(run_dir, "best") and name == run_dir.name and found[0].name == "poems"
    assert check_base_and_adapters(folder, "best", None, ())[:2] == (folder, run_dir.name)  # a checkpoint as --run


@pytest.mark.parametrize("flags, phrase", [
    (["poems"], "is not NAME=DIR"),
    (["=x"], "is not NAME=DIR"),
    (["poems="], "is not NAME=DIR"),
    (["my poems=x"], "a model name has no spaces"),
    (["{poems}", "poems={code}"], "is given twice"),
    (["tiny-run={poems_dir}"], "is the base model's name"),
    (["whole={run}"], "holds a whole model, not a LoRA adapter"),
    (["gone={run}/missing"], "does not exist"),
    (["other={other}"], "not the one served"),
    (["rows={rows}"], "also trains the rows of 2 new tokens"),
])
def test_what_is_refused_before_the_server_starts(flags, phrase, run_dir, adapters, tmp_path, capsys):
    other = make_run(tmp_path / "other-run", seed=1) if "{other}" in "".join(flags) else None
    if other is not None:
        make_lora_run(tmp_path / "other-lora", checkpoint_path(other, "best"), seed=4)
    if "{rows}" in "".join(flags):
        make_lora_run(tmp_path / "rows-lora", checkpoint_path(run_dir, "best"), seed=5, new_tokens=2)
    names = {"poems": f"poems={adapters['poems']}", "poems_dir": adapters["poems"], "code": adapters["code"],
             "run": run_dir, "other": tmp_path / "other-lora", "rows": tmp_path / "rows-lora"}
    args = ["serve", "--run", str(run_dir), "--port", "0"]
    for flag in flags:
        args += ["--adapter", flag.format(**names)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err


def test_adapters_of_two_bases_without_run_are_refused(adapters, tmp_path, capsys):
    other = make_run(tmp_path / "other-run", seed=1)
    lora = make_lora_run(tmp_path / "other-lora", checkpoint_path(other, "best"), seed=4)
    assert main(["serve", "--port", "0", "--adapter", f"poems={adapters['poems']}", "--adapter", f"b={lora}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "adapt different models" in err[0], err
