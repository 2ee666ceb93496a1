"""Benchmark tasks (`tinylm.data.mc_tasks`) and `tinylm eval --task` / `tinylm compare --task` on them.

The few-shot prompt is built exactly as documented (solved examples, each followed by a blank line, then the
question), and K + 1 shots are K shots and one more; task files are read by their keys, with their train split
beside them, and a bad line is one error naming the file and the line; conversation files and ``tasks:NAME``
stay chat tasks. The built-in tasks are the same for the same seed, their train and test splits share no line,
and an in-context item's examples follow its own mapping. End to end: `tinylm eval --task FILE --shots 0,1
--json` prints one object per number of shots, what `score_task` computes, and `tinylm compare --task` draws
the curves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tinylm.cli import main
from tinylm.config import Config, GPTConfig, TrainConfig
from tinylm.data.mc_tasks import (BUILTIN_TASKS, CHOICE, GENERATION, ChoiceItem, GenerationItem, Task, load_task,
                                  make_builtin, read_task_file)
from tinylm.errors import TinyLMError
from tinylm.model import GPT, NGramModel
from tinylm.run import NGRAM_FILE, checkpoint_path, load_run, save_checkpoint, write_run_files
from tinylm.task_eval import draw_shots, few_shot_prompt, is_chat_task, score_task
from tinylm.tokenizers import CharTokenizer

TEXT = "the king rode to war while bells rang out over quiet fields and the queen of night sang\n"


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_few_shot_prompt_is_solved_examples_then_the_question():
    train = [ChoiceItem("the king", (" rode", " sang"), 0), ChoiceItem("the queen", (" rode", " sang"), 1)]
    question = ChoiceItem("the night", (" rode", " fell"), 1)
    task = Task("t", CHOICE, [question], train)
    first, second = draw_shots(task, 0, 2)
    assert {first, second} == set(train)
    assert few_shot_prompt(question, [first, second]) == f"{first.solved}\n\n{second.solved}\n\nthe night"
    assert few_shot_prompt(train[0], train) == "the king rode\n\nthe queen sang\n\nthe king"
    assert few_shot_prompt(question, []) == "the night"
    gen = GenerationItem("dax ->", " dax")
    assert few_shot_prompt(GenerationItem("wug ->", " wug"), [gen]) == "dax -> dax\n\nwug ->"


def test_more_shots_add_to_fewer_and_the_seed_picks_them():
    task = Task("t", GENERATION, [GenerationItem(f"q{i}", "a") for i in range(5)],
                [GenerationItem(f"x{i} ->", f" {i}") for i in range(50)])
    for index in range(5):
        eight = draw_shots(task, index, 8)
        assert len(set(eight)) == 8
        assert [draw_shots(task, index, k) for k in (1, 2, 4)] == [eight[:1], eight[:2], eight[:4]]
    assert draw_shots(task, 0, 4) == draw_shots(task, 0, 4, seed=1234)
    assert draw_shots(task, 0, 4) != draw_shots(task, 0, 4, seed=7)
    assert draw_shots(task, 0, 4) != draw_shots(task, 1, 4)  # each question its own examples


def test_an_item_with_examples_of_its_own_draws_from_them():
    own = tuple(ChoiceItem(f"w{i} ->", (" red", " blue"), i % 2) for i in range(6))
    task = Task("t", CHOICE, [ChoiceItem("w0 ->", (" red", " blue"), 0, own)], [ChoiceItem("x", ("y", "z"), 0)])
    assert set(draw_shots(task, 0, 3)) <= set(own)


def test_task_files_by_their_keys_with_the_train_split_beside(tmp_path):
    mc = write(tmp_path / "quiz.jsonl", [{"context": "the king", "choices": [" rode", " sang"], "answer": 0},
                                         {"context": "the queen", "choices": [" rode", " sang"], "answer": 1, "id": 7}])
    write(tmp_path / "quiz.train.jsonl", [{"context": "a", "choices": [" b", " c"], "answer": 1}])
    gen = write(tmp_path / "copy.jsonl", [{"prompt": "dax ->", "answer": " dax"},
                                          {"prompt": "wug ->", "answer": " wug", "stop": [".", "\n\n"]}])
    task = load_task(str(mc))
    assert (task.kind, len(task.test), task.train) == (CHOICE, 2, [ChoiceItem("a", (" b", " c"), 1)])
    assert read_task_file(gen) == (GENERATION, [GenerationItem("dax ->", " dax"),
                                                GenerationItem("wug ->", " wug", (".", "\n\n"))])
    assert load_task(str(gen)).train is None
    other = write(tmp_path / "elsewhere.jsonl", [{"prompt": "a ->", "answer": " a"}])
    assert load_task(str(gen), train_file=str(other)).train == [GenerationItem("a ->", " a")]
    chats = write(tmp_path / "chats.jsonl", [{"prompt": "hi", "completion": "hello"}])
    assert is_chat_task(str(chats)) and is_chat_task("tasks:add")
    assert not is_chat_task(str(mc)) and not is_chat_task("mc:cloze")


@pytest.mark.parametrize("rows, line, says", [
    (['{"context": "a", "choices": [" b", " c"], "answer": 0}', '{"context": "a", "choices": [" b"'], 2,
     "is not valid JSON"),
    ([{"context": "a", "choices": [" b", " c"], "answer": 2}], 1, '"answer" must be the index of the right choice'),
    ([{"context": "a", "choices": [" b", " c"], "answer": True}], 1, '"answer" must be the index'),
    ([{"context": "a", "choices": [" b"], "answer": 0}], 1, '"choices" must be a list of at least two'),
    ([{"context": 3, "choices": [" b", " c"], "answer": 0}], 1, '"context" must be a string'),
    ([{"prompt": "a", "answer": "b"}, {"context": "a", "choices": [" b", " c"], "answer": 0}], 2,
     "is a multiple choice item, but the file's first item made it a generation task"),
    ([{"prompt": "a", "answer": 1}], 1, '"prompt" and "answer" must both be strings'),
    ([{"prompt": "a", "answer": "b", "stop": [""]}], 1, '"stop" must be a list of non-empty strings'),
    (["", '["a"]'], 2, "is not a JSON object"),
    ([{"question": "a"}], 1, "has the keys question"),
])
def test_a_bad_task_file_is_one_line_naming_the_line(tmp_path, capsys, rows, line, says):
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TinyLMError, match=f"bad.jsonl line {line}") as error:
        load_task(str(path))
    assert says in str(error.value) and "\n" not in str(error.value)
    assert main(["eval", "--run", str(tmp_path), "--task", str(path)]) == 2  # refused before any run is read
    assert f"line {line}" in capsys.readouterr().err


def test_shots_without_a_train_split_and_unknown_tasks_are_one_line(tmp_path):
    path = write(tmp_path / "quiz.jsonl", [{"context": "a", "choices": [" b", " c"], "answer": 0}])
    task = load_task(str(path))
    with pytest.raises(TinyLMError, match="quiz.jsonl has no train split to draw 2 shots from"):
        draw_shots(task, 0, 2)
    with pytest.raises(TinyLMError, match="did you mean 'mc:cloze'"):
        load_task("mc:clozee")
    with pytest.raises(TinyLMError, match="--train-file is for task files"):
        load_task("icl:copy", train_file=str(path))


# ----- the built-in tasks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILTIN_TASKS))
def test_a_built_in_task_is_the_same_for_a_seed_and_its_splits_share_no_line(name, shakespeare_corpus):
    spec = BUILTIN_TASKS[name]
    test, train = make_builtin(name, "test", 100), make_builtin(name, "train", 300)
    assert test == make_builtin(name, "test", 100) and len(test) == 100 and len(train) == 300
    assert make_builtin(name, "test", 100, seed=1) != test
    assert 0 <= spec.chance < 1 and spec.description
    questions = {item.question for item in test}
    assert not questions & {item.question for item in train} or name == "icl:mapping"  # four words, many items
    if spec.kind == CHOICE:
        assert all(len(item.choices) == 4 and 0 <= item.answer < 4 for item in test)
        assert all(sum(item.answer == k for item in test) >= 10 for k in range(4))  # the right choice is anywhere
    if name.startswith("mc:"):  # held-out lines: the line (or the blanked one) is in no item of the other split
        lines = {item.solved.split("\n")[-1] for item in train}
        assert not {item.solved.split("\n")[-1] for item in test} & lines


def test_an_in_context_item_s_examples_follow_its_own_mapping(shakespeare_corpus):
    for item in make_builtin("icl:mapping", "test", 50):
        colour = {}
        for example in (*item.examples, item):
            word = example.context.removesuffix(" ->")
            assert colour.setdefault(word, example.answer) == example.answer
        assert len(colour) <= 4 and len(item.examples) == 16


# ----- end to end ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A GPT with random weights and a trigram counted on TEXT, as run folders with one char tokenizer."""
    tokenizer = CharTokenizer.train([TEXT])
    folder = tmp_path_factory.mktemp("runs")
    torch.manual_seed(0)
    config = Config(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, d_model=16, n_head=2),
                    TrainConfig())
    save_checkpoint(checkpoint_path(folder / "gpt", "best"), model_state=GPT(config.model).state_dict(),
                    optimizer_state=None, rng_state={}, state={"step": 0}, config=config, tokenizer=tokenizer)
    write_run_files(folder / "gpt", config, tokenizer, {"status": "complete", "family": "gpt"})
    config = Config(GPTConfig(family="ngram", vocab_size=tokenizer.vocab_size, block_size=64, order=3), TrainConfig())
    (folder / "ngram").mkdir()
    NGramModel.fit([tokenizer.encode(TEXT)], 3, tokenizer=tokenizer).save(folder / "ngram" / NGRAM_FILE)
    write_run_files(folder / "ngram", config, tokenizer, {"status": "complete", "family": "ngram"})
    return {"gpt": folder / "gpt", "ngram": folder / "ngram"}


@pytest.fixture(scope="module")
def quiz(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("quiz")
    words = TEXT.split()
    rows = [{"context": " ".join(words[i:i + 3]), "choices": [f" {words[i + 3]}", f" {words[i + 5]}", " fields"],
             "answer": 0} for i in range(0, 10)]
    write(folder / "quiz.train.jsonl", rows[:5])
    return write(folder / "quiz.jsonl", rows[5:])


def test_tinylm_eval_task_json_is_score_task_s_numbers(runs, quiz, capsys, tmp_path):
    assert main(["eval", "--run", str(runs["gpt"]), "--task", str(quiz), "--shots", "0,1", "--json",
                 "--plot", str(tmp_path / "icl.png")]) == 0
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    assert [(o["task"], o["n"], o["shots"]) for o in lines] == [("quiz.jsonl", 5, 0), ("quiz.jsonl", 5, 1)]
    run = load_run(runs["gpt"])
    for o in lines:
        expected = score_task(run.model, run.tokenizer, load_task(str(quiz)), shots=o["shots"],
                              start_ids=run.start_ids)
        assert (o["accuracy"], o["accuracy_norm"]) == (expected.accuracy, expected.accuracy_norm)
    assert (tmp_path / "icl.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--run", str(runs["ngram"]), "--task", str(quiz)]) == 0
    assert "quiz.jsonl (multiple choice, 5 test items)" in capsys.readouterr().out


def test_a_generation_task_end_to_end(runs, tmp_path, capsys):
    rows = [{"prompt": f"{w} ->", "answer": f" {w}"} for w in TEXT.split()[:6]]
    task = write(tmp_path / "copy.jsonl", rows)
    write(tmp_path / "copy.train.jsonl", rows)
    for run in runs.values():
        assert main(["eval", "--run", str(run), "--task", str(task), "--shots", "2", "--json"]) == 0
        (result,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert result["kind"] == "generation" and result["n"] == 6 and "accuracy_norm" not in result


def test_tinylm_compare_task_puts_runs_side_by_side(runs, quiz, tmp_path, capsys):
    chart = tmp_path / "curves.png"
    assert main(["compare", str(runs["gpt"]), str(runs["ngram"]), "--task", str(quiz), "--shots", "0,2",
                 "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "0-shot" in out and "2-shot" in out and "gpt" in out and "ngram" in out
    assert chart.read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", "--run", str(runs["gpt"]), "--task", "tasks:add", "--shots", "1"]) == 2
    assert "are for benchmark tasks" in capsys.readouterr().err
