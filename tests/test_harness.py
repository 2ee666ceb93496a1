"""The lm-evaluation-harness adapter (`tinylm.harness`) against the harness's own HFLM on the Hugging Face export.

A tiny GPT run (random weights, a BPE tokenizer, context 64) is exported with `export_hf`; lm_eval's `HFLM`
runs the example tasks of examples/harness on the export, `TinyLMHarness` on the run, and every item's
log-likelihood, greedy flag, generation and the accuracies must agree. The few-shot contexts are longer than
the context of 64, so both cut them from the left. Rolling log-likelihoods are checked against `tinylm eval`'s
sums (`tinylm.evaluate`) and against HFLM reading the text without a start token of its own; an LSTM and an
n-gram run against their own models' probabilities; and `tinylm eval --harness` end to end, offline.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import lm_eval
import numpy as np
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from runkit import write_model_run
from tinylm.cli import main
from tinylm.config import Config, GPTConfig, TrainConfig
from tinylm.errors import TinyLMError
from tinylm.evaluate import EvalText, evaluate_model
from tinylm.export.hf import export_hf
from tinylm.harness import TinyLMHarness, run_harness
from tinylm.model import GPT, NGramLM, NGramModel, RecurrentLM
from tinylm.run import NGRAM_FILE, load_run, write_run_files
from tinylm.tokenizers import train_bpe

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "harness"
TASKS = ["shakespeare_cloze", "shakespeare_lastword"]
BLOCK = 64


def verse() -> str:
    """The example items' two lines each, as one text."""
    rows = [json.loads(line) for line in (EXAMPLES / "test.jsonl").read_text(encoding="utf-8").splitlines()]
    return "\n\n".join(f"{row['context']} {row['answer']}" for row in rows)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([verse()], vocab_size=400, pattern="gpt4", workers=1)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer GPT with random weights spread wide enough (init_std 0.3) that greedy choices are clear."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=2, d_model=32, n_head=4,
                       init_std=0.3)
    return write_model_run(tmp_path_factory.mktemp("gpt"), GPT(config).eval(), tokenizer)


@pytest.fixture(scope="module")
def lstm_run(tmp_path_factory, tokenizer) -> Path:
    torch.manual_seed(1)
    config = GPTConfig(family="lstm", vocab_size=tokenizer.vocab_size, block_size=BLOCK, n_layer=1, d_model=32,
                       n_head=1)
    return write_model_run(tmp_path_factory.mktemp("lstm"), RecurrentLM(config).eval(), tokenizer)


@pytest.fixture(scope="module")
def ngram_run(tmp_path_factory, tokenizer) -> Path:
    """A Kneser-Ney trigram counted on the example verse, in a run folder of its own (context 32)."""
    folder = tmp_path_factory.mktemp("ngram")
    config = Config(GPTConfig(family="ngram", vocab_size=tokenizer.vocab_size, block_size=32, order=3),
                    TrainConfig())
    ids = [t for line in verse().split("\n\n") for t in tokenizer.encode(line) + [tokenizer.eos_id]]
    NGramModel.fit(ids, 3, tokenizer=tokenizer, smoothing="kn").save(folder / NGRAM_FILE)
    write_run_files(folder, config, tokenizer, {"status": "complete"})
    return folder


@pytest.fixture(scope="module")
def export(tmp_path_factory, gpt_run) -> Path:
    run = load_run(gpt_run)
    return export_hf(run.model, run.tokenizer, tmp_path_factory.mktemp("hf") / "export", start_ids=run.start_ids)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test reaches the hub; whatever `run_harness` sets in the environment is undone after each test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def hflm_results(export):
    """The harness's own HFLM on the export, offline, from the examples' folder (lm_eval reads data_files there)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(EXAMPLES)
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        manager = TaskManager(include_path=str(EXAMPLES), include_defaults=False)
        return lm_eval.simple_evaluate(model=HFLM(pretrained=str(export), batch_size=8, device="cpu"),
                                       tasks=TASKS, num_fewshot=1, limit=30, task_manager=manager)


def test_multiple_choice_and_generation_are_hflm_s_on_the_export(gpt_run, hflm_results):
    ours = run_harness(gpt_run, TASKS, include_path=str(EXAMPLES), shots=1, limit=30, batch_size=8)
    theirs_mc, ours_mc = samples(hflm_results, TASKS[0]), samples(ours, TASKS[0])
    assert [s["doc_id"] for s in ours_mc] == [s["doc_id"] for s in theirs_mc] == list(range(30))
    a = np.array([[r[0][0] for r in s["resps"]] for s in theirs_mc])  # (items, choices) log-likelihoods
    b = np.array([[r[0][0] for r in s["resps"]] for s in ours_mc])
    assert a.shape == (30, 4) and np.abs(a - b).max() < 1e-4
    assert [[r[0][1] for r in s["resps"]] for s in theirs_mc] == [[r[0][1] for r in s["resps"]] for s in ours_mc]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][TASKS[0]][metric] == hflm_results["results"][TASKS[0]][metric]
    # the few-shot contexts outgrow the context of 64 tokens: both cut them from the left the same way
    lm = TinyLMHarness(str(gpt_run))
    assert max(len(lm.tok_encode(s["arguments"][0][0])) for s in ours_mc) > BLOCK
    theirs_gen, ours_gen = samples(hflm_results, TASKS[1]), samples(ours, TASKS[1])
    assert [s["resps"] for s in ours_gen] == [s["resps"] for s in theirs_gen]
    assert any(s["resps"][0][0] for s in ours_gen)  # not all empty: the comparison says something
    assert (ours["results"][TASKS[1]]["exact_match,first-word"]
            == hflm_results["results"][TASKS[1]]["exact_match,first-word"])


def rolling(lm, texts: list[str]) -> list[float]:
    return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])


def whole_windows_text(tokenizer, n_windows: int) -> str:
    """A text of exactly ``n_windows`` * BLOCK tokens (so that the harness's windows are `tinylm eval`'s)."""
    ids = tokenizer.encode(verse())
    for end in range(n_windows * BLOCK, len(ids)):
        text = tokenizer.decode(ids[:end])
        if len(tokenizer.encode(text)) == n_windows * BLOCK:
            return text
    raise AssertionError("no cut of the verse re-encodes to whole windows")


def test_rolling_loglikelihood_is_tinylm_eval_s_bits_per_byte(gpt_run, tokenizer):
    lm = TinyLMHarness(str(gpt_run), batch_size=4)
    texts = [whole_windows_text(tokenizer, 3), "Shall I compare thee to a summer's day?"]
    for text, ll in zip(texts, rolling(lm, texts)):
        result = evaluate_model(lm.model, EvalText("text", np.array(tokenizer.encode(text)), len(text.encode())),
                                tokenizer, block_size=BLOCK, start_id=lm.run.start_ids[-1])
        assert -ll / (len(text.encode()) * math.log(2)) == pytest.approx(result.bits_per_byte, rel=1e-6)


def test_rolling_windows_are_hflm_s_when_it_adds_no_start_token(gpt_run, export, tokenizer):
    """HFLM scores the start token its tokenizer puts first as the text's first target; without it (and with
    the last window's full context, which `tinylm eval` does not give) the sums are the same."""
    texts = [verse()[:3000], "Rich only in large hurts"]
    ours = rolling(TinyLMHarness(str(gpt_run), batch_size=4), texts)
    theirs = rolling(HFLM(pretrained=str(export), batch_size=4, device="cpu", add_bos_token=False), texts)
    assert len(tokenizer.encode(texts[0])) % BLOCK != 0  # a last window that is not whole
    assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-3  # sums of ~1000 tokens' float32 log-probs
    assert abs(ours[1] - theirs[1]) < 1e-4


def generation(lm, context: str, **kwargs) -> str:
    return lm.generate_until([Instance("generate_until", {}, (context, kwargs), 0)])[0]


def test_generate_until_stops_at_the_until_strings(gpt_run):
    lm = TinyLMHarness(str(gpt_run), batch_size=4)
    context = "Rich only in large hurts: all those for this?\nIs this the"
    free = generation(lm, context, until=[], max_gen_toks=24, do_sample=False)
    assert len(free) > 12
    stop, earlier = free[8:11], free[4:6]
    assert generation(lm, context, until=[stop], max_gen_toks=24) == free.split(stop)[0]
    assert generation(lm, context, until=[stop, earlier], max_gen_toks=24) == free.split(earlier)[0].split(stop)[0]
    # the task's max_gen_toks must leave room for the context: one clear line, not a crash
    with pytest.raises(TinyLMError, match="max_gen_toks"):
        generation(lm, context, until=["\n"], max_gen_toks=BLOCK)


def by_hand(run, context: str, continuation: str) -> float:
    """log p(continuation | start + context) from the model's own next-token distributions, one token at a time
    (an n-gram's from its counts: its forward leaves out the special tokens, which are never generated)."""
    tok = run.tokenizer
    ids = run.start_ids + tok.encode(context)
    cont = (run.start_ids + tok.encode(context + continuation))[len(ids):]
    total = 0.0
    for token in cont:
        if isinstance(run.model, NGramLM):
            total += math.log(run.model.ngram.next_token_distribution(ids)[token])
        else:
            with torch.no_grad():
                logits = run.model(torch.tensor([ids]))[0][0, -1]
            total += float(torch.log_softmax(logits.double(), -1)[token])
        ids = ids + [token]
    return total


@pytest.mark.parametrize("family", ["lstm", "ngram"])
def test_lstm_and_ngram_runs_go_through_the_adapter(family, lstm_run, ngram_run, tokenizer):
    folder = {"lstm": lstm_run, "ngram": ngram_run}[family]
    run = load_run(folder)
    lm = lm_eval.api.registry.get_model("tinylm").create_from_arg_string(f"run={folder},batch_size=3")
    pairs = [("Rich only in large hurts: all those", " for this?"), ("Is this the balsam", " that"),
             ("Thou rascal beadle, hold thy bloody", " hand!"), ("Why dost thou lash", " that whore?")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert [ll for ll, _ in got] == pytest.approx([by_hand(run, *pair) for pair in pairs], abs=1e-4)
    # a text of several windows: the n-gram keeps its whole context across them, as `tinylm eval` reads it
    text = whole_windows_text(tokenizer, 2) if family == "lstm" else verse()[:2000]
    result = evaluate_model(run.model, EvalText("text", np.array(tokenizer.encode(text)), len(text.encode())),
                            tokenizer, block_size=run.config.model.block_size, start_id=run.start_ids[-1])
    assert len(tokenizer.encode(text)) >= 2 * run.config.model.block_size
    assert -rolling(lm, [text])[0] == pytest.approx(result.loss_sum, rel=1e-6)
    written = generation(lm, "Rich only in large hurts: all those for this?\n", until=["\n"], max_gen_toks=10)
    assert isinstance(written, str) and "\n" not in written


def test_tinylm_eval_harness_end_to_end_offline(gpt_run, hflm_results, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # data_files are read beside the YAMLs, wherever the command runs
    assert main(["eval", "--run", str(gpt_run), "--harness", ",".join(TASKS), "--include-path", str(EXAMPLES),
                 "--shots", "1", "--limit", "10", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    theirs = samples(hflm_results, TASKS[0])[:10]
    assert out["tasks"][TASKS[0]]["acc,none"] == pytest.approx(np.mean([s["acc"] for s in theirs]))
    assert out["n-shot"] == {TASKS[0]: 1, TASKS[1]: 1}
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"  # local tasks only: datasets never waits on the network
    assert main(["eval", "--run", str(gpt_run), "--harness", "shakespeare_cloze", "--include-path",
                 str(EXAMPLES), "--limit", "3"]) == 0
    assert "shakespeare_cloze" in capsys.readouterr().out


def test_mistakes_are_one_line(gpt_run, tmp_path, monkeypatch, capsys):
    assert main(["eval", "--run", str(gpt_run), "--harness", TASKS[0], "--include-path", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    # without lm_eval installed, the command says how to install it
    for name in [name for name in sys.modules if name.split(".")[0] == "lm_eval"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "tinylm.harness")
    assert main(["eval", "--run", str(gpt_run), "--harness", TASKS[0]]) == 2
    assert capsys.readouterr().err.strip() == ('tinylm: error: lm-evaluation-harness is not installed; install it '
                                                'with: pip install -e ".[harness]"')
