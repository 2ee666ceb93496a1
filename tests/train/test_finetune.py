"""`tinylm finetune`: a tiny trained run taught a reply pattern from conversations, end to end.

What is checked: the loss counts only what the assistant writes (the targets of a batch, worked out from
the conversations by hand); the result is an ordinary run folder with the chat tokens, a grown model and
the conversation batches; a run stopped part way and resumed ends with the same weights as one that was
not; bad conversation files are one error line naming the line; task scoring counts exact answers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diskkit import refused
from trainkit import tiny_config

from tinylm.data.chat_shards import chat_arrays, prepare_chats
from tinylm.finetune import finetune, recipe
from tinylm.model.gpt import IGNORE_INDEX
from tinylm.checkpoint import load_checkpoint
from tinylm.run import load_run
from tinylm.tokenizers.base import CHAT_END, CHAT_START
from tinylm.tokenizers.chat_template import with_chat_tokens
from tinylm.train import BatchSource, train

PAIRS = [("the king", "rode to war"), ("my lord", "speak soft"), ("quiet fields", "bells rang"),
         ("gold", "and blood"), ("the queen", "of night"), ("here is", "the stair")]


def chats(n: int = 36) -> list[dict]:
    return [{"prompt": PAIRS[i % len(PAIRS)][0], "completion": PAIRS[i % len(PAIRS)][1]} for i in range(n)]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus, data_dir):
    out = tmp_path_factory.mktemp("base") / "run"
    train(tiny_config(corpus, data_dir, max_steps=6), out, log=lambda line: None)
    return out


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats()), encoding="utf-8")
    return path


FLAGS = {"max_steps": 6, "batch_size": 4, "eval_interval": 3, "log_interval": 1, "sample_tokens": 8}


def test_a_fine_tuned_run_is_an_ordinary_run_with_chat_tokens(base_run, chat_file, tmp_path):
    said = []
    result = finetune(base_run, str(chat_file), tmp_path / "chat", overrides=FLAGS, data_dir=tmp_path / "data",
                      log=said.append)
    assert result.status == "complete" and result.step == 6
    run = load_run(tmp_path / "chat")
    base = load_run(base_run)
    assert run.tokenizer.vocab_size == base.tokenizer.vocab_size + 2
    assert run.tokenizer.special_tokens[CHAT_START] == base.tokenizer.vocab_size
    assert run.model.config.vocab_size == base.model.config.vocab_size + 2
    assert run.config.train.batch_mode == "chats"
    assert any("of the assistant's" in line or "are the assistant's" in line for line in said)
    evals = [m for m in run.metrics if m.get("kind") == "eval"]
    assert evals and all(np.isfinite(m["val_loss"]) for m in evals)
    # the start: the base model's rows as they were, and the two new ones their mean
    start = load_checkpoint(tmp_path / "data" / "init").model_state()["E.weight"]
    learned = base.model.state_dict()["E.weight"]
    assert torch.equal(start[:-2], learned)
    assert torch.allclose(start[-2:], learned.mean(dim=0).expand(2, -1))


def test_only_the_assistants_tokens_are_targets(base_run, tmp_path):
    tok = with_chat_tokens(load_run(base_run).tokenizer)
    one = [[{"role": "user", "content": "the king"}, {"role": "assistant", "content": "rode to war"}]]
    other = [[{"role": "user", "content": "the queen"}, {"role": "assistant", "content": "rode to war"}]]
    rows = {}
    for name, convs in (("one", one), ("other", other)):
        shards = prepare_chats({"train": convs, "val": convs}, tok, tmp_path / name, block_size=64, source=name)
        src = BatchSource(shards, mode="chats", batch_size=1, block_size=64, seed=0, bos_id=tok.bos_id,
                          pad_id=tok.pad_id)
        rows[name] = src.step_batch(0)
    y = rows["one"].y[0]
    targets = [int(t) for t in y if t != IGNORE_INDEX]
    # by hand: the reply's characters and the end-of-turn token, nothing the user or the template wrote
    assert targets == tok.encode("rode to war") + [tok.special_tokens[CHAT_END]]
    # another user message: other inputs, the same targets (shifted by the longer prompt)
    assert not np.array_equal(rows["one"].x, rows["other"].x)
    assert [int(t) for t in rows["other"].y[0] if t != IGNORE_INDEX] == targets
    tokens, trained, offsets = chat_arrays(shards, "train")
    assert offsets.tolist() == [0, len(tokens)] and trained.sum() == len(targets)


def test_a_stopped_fine_tuning_resumes_to_the_same_weights(base_run, chat_file, tmp_path):
    whole = finetune(base_run, str(chat_file), tmp_path / "whole", overrides=FLAGS, data_dir=tmp_path / "d1",
                     log=lambda line: None)
    stopped = finetune(base_run, str(chat_file), tmp_path / "parts", overrides=FLAGS, data_dir=tmp_path / "d2",
                       stop_after=2, log=lambda line: None)
    assert stopped.status == "stopped" and stopped.step == 2
    resumed = finetune(None, None, tmp_path / "parts", resume=True, log=lambda line: None)
    assert whole.step == resumed.step == 6
    a = load_run(tmp_path / "whole", "latest").model.state_dict()
    b = load_run(tmp_path / "parts", "latest").model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_default_budget_is_two_epochs_at_the_base_runs_rates(base_run, tmp_path):
    from tinylm.finetune import MIN_STEPS

    base = load_run(base_run).config
    config = recipe(base, base.model.vocab_size + 2, 4000, tmp_path, None, {"batch_size": "4"})
    assert config.train.max_steps == 2000  # 4,000 packed rows, 4 a step, twice
    assert config.train.lr == base.train.lr and config.train.batch_mode == "chats"
    assert recipe(base, 10, 40, tmp_path, None, {"batch_size": 4}).train.max_steps == MIN_STEPS  # a small set
    assert recipe(base, 10, 40, tmp_path, 2.5, {"batch_size": 4}).train.max_steps == 25  # --epochs as given


def test_bad_conversations_are_one_line_naming_the_line(capsys, base_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + '{"prompt": 3}\n', encoding="utf-8")
    refused(capsys, ["finetune", "--from", str(base_run), "--data", str(bad), "--out", str(tmp_path / "x")],
            "line 2")
    refused(capsys, ["finetune", "--from", str(base_run), "--data", "tasks:nope", "--out", str(tmp_path / "x")],
            "nope")
    refused(capsys, ["finetune", "--from", str(tmp_path / "missing"), "--data", str(bad), "--out",
                     str(tmp_path / "x")], "no such run")
    refused(capsys, ["finetune", "--from", str(base_run), "--data", str(bad), "--out", str(tmp_path / "x"),
                     "--corpus", "shakespeare"], "--corpus")
    assert not (tmp_path / "x").exists()


def test_task_scores_count_the_exact_greedy_replies(base_run, chat_file, tmp_path):
    from tinylm.data.tasks import exact_match
    from tinylm.generate.engine import Engine
    from tinylm.generate.sampling import SamplingParams
    from tinylm.task_eval import evaluate_run_tasks, reply_tokens
    from tinylm.tokenizers.chat_template import chat_prompt_ids

    finetune(base_run, str(chat_file), tmp_path / "chat", overrides={**FLAGS, "max_steps": 12},
             data_dir=tmp_path / "data", log=lambda line: None)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(c) + "\n" for c in chats(6)), encoding="utf-8")
    (score,) = evaluate_run_tasks(str(tmp_path / "chat"), str(held_out))
    run = load_run(tmp_path / "chat")
    prompts = [chat_prompt_ids(run.tokenizer, [{"role": "user", "content": p}]) for p, _ in PAIRS]
    replies = Engine(run.model, SamplingParams(max_new_tokens=reply_tokens(run.model, prompts), temperature=0.0),
                     run.tokenizer).generate(prompts)
    expected = sum(exact_match(r.text, answer) for r, (_, answer) in zip(replies, PAIRS))
    ended = sum(r.stop == run.tokenizer.special_tokens[CHAT_END] for r in replies)
    assert (score.items, score.exact, score.ended) == (6, expected, ended)
    # the examples shown: the misses first, in order, then the exact replies
    shown = [(p, a, r.text) for r, (p, a) in zip(replies, PAIRS)]
    misses = [e for e in shown if not exact_match(e[2], e[1])]
    assert score.examples == (misses + [e for e in shown if e not in misses])[:3]
    with pytest.raises(Exception, match="does not end with the assistant"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"},
                                                {"role": "user", "content": "x"}]}) + "\n", encoding="utf-8")
        evaluate_run_tasks(str(tmp_path / "chat"), str(bad))


def forty_chats(base_run, folder, block_size: int) -> tuple:
    """Forty short chats of several lengths as conversation shards, and a source of packed steps of 2 rows."""
    tok = with_chat_tokens(load_run(base_run).tokenizer)
    convs = [[{"role": "user", "content": "the" + " e" * (i % 7)}, {"role": "assistant", "content": "to" * (1 + i % 5)}]
             for i in range(40)]
    shards = prepare_chats({"train": convs, "val": convs[:2]}, tok, folder, block_size=block_size, source="t")
    return shards, BatchSource(shards, mode="chats", batch_size=2, block_size=block_size, seed=3, bos_id=tok.bos_id,
                               pad_id=tok.pad_id)


def test_packed_steps_go_through_every_conversation_once_an_epoch(base_run, tmp_path):
    shards, src = forty_chats(base_run, tmp_path / "d", 128)
    tokens, trained, offsets = chat_arrays(shards, "train")
    sizes = [len(src.packed_epoch(e)) for e in range(3)]
    assert sizes[0] < 40 / 2  # several conversations a row
    for e in range(3):
        assert sorted(np.concatenate(src.packed_epoch(e)).tolist()) == list(range(40))
    # the steps take the packed rows in turn, across the epochs' boundaries
    rows = src.chat_rows(0, sum(sizes))
    assert [r.tolist() for r in rows] == [r.tolist() for e in range(3) for r in src.packed_epoch(e)]
    # a step is a function of its number alone: a fresh source (a resumed run) draws the same rows
    _, fresh = forty_chats(base_run, tmp_path / "d", 128)  # the shards are there: reused
    step = sizes[0] // 2 + 1  # in the second epoch
    a, b = src.step_batch(step), fresh.step_batch(step)
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y) and np.array_equal(a.segments, b.segments)
    # every trained token of the step's conversations is a target, nothing else is
    chats_in_step = np.concatenate(src.chat_rows(2 * step, 2))
    assert a.n_targets == sum(int(trained[offsets[c] + 1:offsets[c + 1]].sum()) for c in chats_in_step)
    assert a.n_inputs == sum(int(offsets[c + 1] - offsets[c] - 1) for c in chats_in_step)


def test_short_chats_in_a_long_context_take_shorter_rows_with_the_same_positions_a_step(base_run, tmp_path):
    _, src = forty_chats(base_run, tmp_path / "d", 512)
    assert src.chat_width == 128
    batch = src.step_batch(1, grad_accum=2)
    assert batch.x.shape[0] == 2 * 2 * 4 and batch.x.shape[1] <= 128  # 4 times as many rows of a quarter
