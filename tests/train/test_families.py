"""Every model family through the same commands: train (--model), eval, sample, compare."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
from trainkit import cli_flags, run_cli, tiny_config

from tinylm.cli import main
from tinylm.data.shards import ShardSet
from tinylm.evaluate import evaluate_run
from tinylm.generate import SamplingParams, reference_generate
from tinylm.model import NGramLM, NGramModel, RecurrentLM
from tinylm.run import load_run
from tinylm.train import train

BPB = re.compile(r"loss ([\d.]+|inf) nats per token, perplexity ([\d.]+|inf), ([\d.]+|inf) bits per byte")


def eval_numbers(stdout: str) -> tuple[float, float, float]:
    loss, ppl, bpb = BPB.search(stdout).groups()
    return float(loss), float(ppl), float(bpb)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, data_dir):
    """One tiny run of each family, all on the same corpus and char tokenizer (made through the CLI)."""
    root = tmp_path_factory.mktemp("families")
    made = {}
    for family, extra in [("gpt", []), ("lstm", ["--bptt", "8"]), ("rnn", []),
                          ("ngram", ["--order", "4"])]:
        out = root / family
        proc = run_cli("train", "--model", family, *cli_flags(corpus, data_dir, max_steps=12), *extra,
                       "--out", str(out), "--no-progress")
        assert proc.returncode == 0, proc.stderr
        made[family] = out
    return made


@pytest.mark.slow
def test_train_model_flag_builds_each_family(runs):
    for family, out in runs.items():
        run = load_run(out)
        assert run.family == family
        if family in ("lstm", "rnn"):
            assert isinstance(run.model, RecurrentLM) and run.model.lstm == (family == "lstm")
            assert (out / "checkpoints" / "latest" / "model.safetensors").is_file()
            assert run.step == 12
        if family == "ngram":
            assert isinstance(run.model, NGramLM) and run.model.ngram.order == 4
            assert (out / "ngram.npz").is_file() and not (out / "checkpoints").exists()
        info = json.loads((out / "run.json").read_text())
        assert info["status"] == "complete" and math.isfinite(info["final"]["bits_per_byte"])


def test_recurrent_training_resumes_exactly(tmp_path, corpus, data_dir):
    config = tiny_config(corpus, data_dir, family="lstm", bptt=8, max_steps=6, eval_interval=3)
    whole = train(config, tmp_path / "whole", progress=False, log=lambda line: None)
    train(config, tmp_path / "halves", stop_after=3, progress=False, log=lambda line: None)
    halves = train(None, tmp_path / "halves", resume=True, progress=False, log=lambda line: None)
    assert whole.train_loss == halves.train_loss
    a, b = load_run(tmp_path / "whole", "latest").model, load_run(tmp_path / "halves", "latest").model
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.slow
def test_eval_reports_every_family_and_bits_per_byte_is_the_formula(runs, data_dir):
    shards = ShardSet.open(data_dir)
    val_bytes = shards.meta["splits"]["val"]["bytes"]
    for family, out in runs.items():
        proc = run_cli("eval", "--run", str(out))
        assert proc.returncode == 0, proc.stderr
        loss, ppl, bpb = eval_numbers(proc.stdout)
        tokens, n_bytes = re.search(r"([\d,]+) tokens, ([\d,]+) bytes", proc.stdout).groups()
        tokens, n_bytes = int(tokens.replace(",", "")), int(n_bytes.replace(",", ""))
        assert tokens == shards.num_tokens("val") and n_bytes == val_bytes
        assert bpb == pytest.approx(loss * tokens / (n_bytes * math.log(2)), rel=1e-3)
        assert ppl == pytest.approx(math.exp(loss), abs=0.006)  # printed with two decimals
        assert re.search(r"\d+\.\d s$", proc.stdout.strip())  # the time it took


@pytest.mark.slow
def test_ngram_run_evaluates_as_the_counted_model_does(runs, data_dir):
    shards = ShardSet.open(data_dir)
    direct = NGramModel.fit_shards(shards, 4).evaluate_shards(shards, "val")
    result = evaluate_run(str(runs["ngram"]))
    assert result.loss_sum == pytest.approx(direct.loss_sum, rel=1e-12)
    assert result.bits_per_byte == pytest.approx(direct.bits_per_byte, rel=1e-12)
    # the bare model file, with the shards' tokenizer
    proc = run_cli("eval", "--run", str(runs["ngram"] / "ngram.npz"), "--data-dir", str(data_dir))
    assert proc.returncode == 0, proc.stderr
    assert eval_numbers(proc.stdout)[2] == pytest.approx(direct.bits_per_byte, abs=1e-4)
    proc = run_cli("eval", "--run", str(runs["ngram"] / "ngram.npz"))  # its tokenizer is beside it, its data is not
    assert proc.returncode == 2 and "does not say where its data is" in proc.stderr and "--data-dir" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_eval_on_any_corpus_and_mle_reports_infinity(tmp_path, runs, corpus, data_dir):
    text = tmp_path / "new.txt"
    text.write_text("The king rode out. Zebras! Quixotic jazz.\n", encoding="utf-8")  # letters never seen
    proc = run_cli("eval", "--run", str(runs["lstm"]), "--corpus", str(text))
    assert proc.returncode == 0, proc.stderr
    assert math.isfinite(eval_numbers(proc.stdout)[2])
    n = len(text.read_bytes())  # ASCII: one character token per byte, then the EOS
    assert f"{n + 1} tokens, {n} bytes" in proc.stdout
    mle = tmp_path / "mle"
    proc = run_cli("train", "--model", "ngram", "--smoothing", "mle", "--order", "2",
                   *cli_flags(corpus, data_dir), "--out", str(mle))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("eval", "--run", str(mle), "--corpus", str(text))
    assert proc.returncode == 0, proc.stderr
    loss, ppl, bpb = eval_numbers(proc.stdout)
    assert math.isinf(loss) and math.isinf(ppl) and math.isinf(bpb)
    as_json = run_cli("eval", "--run", str(mle), "--corpus", str(text), "--json")
    report = json.loads(as_json.stdout)  # strict JSON: no bare Infinity
    assert report["loss"] == report["perplexity"] == report["bits_per_byte"] == "inf"


@pytest.mark.slow
def test_sample_from_every_family_is_reproducible(runs):
    for family, out in runs.items():
        args = ("sample", "--run", str(out), "--prompt", "The king", "--max-new-tokens", "20", "--seed", "7",
                "--top-k", "10")
        first, second = run_cli(*args), run_cli(*args)
        assert first.returncode == 0, first.stderr
        assert first.stdout == second.stdout and "The king" in first.stdout
        assert len(first.stdout.strip()) > len("The king")


def test_ngram_counting_refuses_resume_and_overwrites_only_with_force(runs, corpus, data_dir):
    out = runs["ngram"]
    before = (out / "ngram.npz").read_bytes()
    proc = run_cli("train", "--model", "ngram", *cli_flags(corpus, data_dir), "--out", str(out))
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("train", "--model", "ngram", *cli_flags(corpus, data_dir), "--out", str(out), "--resume")
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr
    assert (out / "ngram.npz").read_bytes() == before


@pytest.mark.slow
def test_compare_three_runs_with_different_tokenizers(tmp_path, runs, corpus, data_dir):
    # a word-level run on the same corpus: another tokenizer, the same held-out documents
    word = tmp_path / "word-ngram"
    proc = run_cli("train", "--model", "ngram", "--order", "3",
                   *cli_flags(corpus, tmp_path / "data-word", tokenizer_kind="word", tokenizer_vocab_size=200),
                   "--out", str(word))
    assert proc.returncode == 0, proc.stderr
    chart = tmp_path / "cmp.png"
    proc = run_cli("compare", str(runs["ngram"]), str(runs["lstm"]), str(runs["gpt"]), str(word),
                   "--plot", str(chart))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [line.split() for line in lines[2:6]]
    assert {r[0] for r in rows} == {"ngram", "lstm", "gpt", "word-ngram"}
    bpbs = [float(r[-3]) for r in rows]
    assert bpbs == sorted(bpbs)  # best first
    assert "different sizes" not in proc.stdout  # the same documents held out, whatever the tokenizer
    for name, bpb in zip([r[0] for r in rows], bpbs):
        path = word if name == "word-ngram" else runs[name]
        assert bpb == pytest.approx(evaluate_run(str(path)).bits_per_byte, abs=1e-4)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one corpus for all of them
    proc = run_cli("compare", str(runs["ngram"]), str(runs["rnn"]), "--corpus", str(corpus), "--plot", str(chart))
    assert proc.returncode == 0, proc.stderr
    assert len({re.sub(r"\s+", " ", line).split(" ")[5] for line in proc.stdout.splitlines()[2:4]}) == 1  # bytes


def test_compare_refuses_to_overwrite_what_is_not_a_chart(tmp_path, runs):
    precious = tmp_path / "notes.png"
    precious.write_text("my notes")
    proc = run_cli("compare", str(runs["ngram"]), "--plot", str(precious))
    assert proc.returncode == 2 and "not a PNG image" in proc.stderr
    assert precious.read_text() == "my notes"
    proc = run_cli("compare", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unknown_characters_are_charged_for_their_bytes(tmp_path, runs, data_dir):
    tok = load_run(runs["ngram"]).tokenizer
    text = tmp_path / "new.txt"
    text.write_text("the king rode out: Zebras, Quixotic jazz, caf\u00e9 \u2603\n", encoding="utf-8")
    content = text.read_text(encoding="utf-8")
    unknown = [ch for ch in content if tok.encode(ch) == [tok.unk_id]]
    assert {"Z", "\u00e9", "\u2603"} <= set(unknown)  # characters the plays never use
    unknown_bytes = sum(len(ch.encode("utf-8")) for ch in unknown)
    for family in ("ngram", "lstm"):
        proc = run_cli("eval", "--run", str(runs[family]), "--corpus", str(text))
        assert proc.returncode == 0, proc.stderr
        loss, _, bpb = eval_numbers(proc.stdout)
        tokens = len(content) + 1  # one token per character, then EOS
        n_bytes = len(content.encode("utf-8"))
        assert f"{len(unknown)} of the tokens are <unk>, standing for {unknown_bytes} bytes" in proc.stdout
        by_hand = (loss * tokens / math.log(2) + 8 * unknown_bytes) / n_bytes
        assert bpb == pytest.approx(by_hand, abs=2e-4)


@pytest.mark.slow
def test_an_ngram_samples_from_its_whole_context_whatever_the_block_size(tmp_path, corpus, data_dir):
    out = tmp_path / "ng"
    proc = run_cli("train", "--model", "ngram", "--order", "6", *cli_flags(corpus, data_dir, block_size=4),
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("sample", "--run", str(out), "--prompt", "My lord", "--temperature", "0", "--max-new-tokens", "60")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    run = load_run(out)
    prompt = run.start_ids + run.tokenizer.encode("My lord")
    # the naive generator reads the whole history at every step: what the n-gram's own greedy choice is
    greedy = SamplingParams(temperature=0, max_new_tokens=60)
    (expected,) = reference_generate(run.model, [prompt], greedy, run.tokenizer)
    assert "My lord" + expected.text in proc.stdout


def test_an_ngram_never_generates_padding_or_markers(runs):
    run = load_run(runs["ngram"])
    tok = run.tokenizer
    assert {tok.bos_id, tok.pad_id, tok.unk_id} <= set(run.model.never) and tok.eos_id not in run.model.never
    logits, _ = run.model(torch.tensor([run.start_ids + tok.encode("The")]))
    assert torch.isinf(logits[0, -1, [tok.bos_id, tok.pad_id]]).all()
    assert not run.model.training


@pytest.mark.slow
def test_a_mistake_with_force_leaves_the_old_run_in_place(tmp_path, runs, corpus, data_dir):
    import shutil

    for family in ("ngram", "lstm"):
        victim = tmp_path / f"victim-{family}"
        shutil.copytree(runs[family], victim)
        before = sorted(p.name for p in victim.rglob("*"))
        proc = run_cli("train", "--model", family, *cli_flags(tmp_path / "no-such-corpus", tmp_path / "d"),
                       "--out", str(victim), "--force")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert sorted(p.name for p in victim.rglob("*")) == before


@pytest.mark.slow
def test_family_mismatches_are_one_clear_line(tmp_path, runs, corpus, data_dir):
    cases = [
        (("train", "--model", "ngram", *cli_flags(corpus, data_dir), "--out", str(runs["lstm"]), "--resume"),
         "is a run of an LSTM model, not an n-gram one"),
        (("train", "--model", "lstm", *cli_flags(corpus, data_dir), "--out", str(runs["ngram"]), "--resume"),
         "is a run of an n-gram model, not an LSTM one"),
        (("train", "--model", "gpt", "--init-from", str(runs["lstm"]), "--out", str(tmp_path / "a")),
         "is a run of an LSTM model; a Transformer (gpt) model cannot start from its weights"),
        (("train", "--init-from", str(runs["ngram"]), *cli_flags(corpus, data_dir), "--out", str(tmp_path / "b")),
         "counts, not weights"),
        (("train", "--bptt", "8", *cli_flags(corpus, data_dir), "--out", str(tmp_path / "c")),
         "bptt (truncated backpropagation through time) applies to the lstm and rnn families"),
        (("eval", "--run", str(runs["lstm"] / "config.toml")), "neither a run folder nor an n-gram model file"),
        (("eval", "--run", str(runs["lstm"]), "--tokenizer", str(runs["lstm"] / "tokenizer.json")),
         "--tokenizer is for a bare n-gram .npz file"),
        (("compare", str(runs["ngram"] / "ngram.npz")), "is a file, not a run folder (an n-gram model file"),
        (("compare", str(tmp_path / "missing-run"), "--plot", str(runs["lstm"] / "run.json")), "give a path ending in .png"),
    ]
    for args, message in cases:
        proc = run_cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, (message, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_second_review_mistakes_are_one_clear_line(tmp_path, runs, corpus, data_dir):
    import shutil

    from tinylm.tokenizers import CharTokenizer

    same = tmp_path / "same"
    proc = run_cli("train", "--model", "lstm", *cli_flags(corpus, same), "--out", str(same))
    assert proc.returncode == 2 and "--data-dir and --out are the same folder" in proc.stderr
    # a bare n-gram file read with a tokenizer of the same size but other ids
    theirs = NGramModel.fit([[0, 1, 2, 1]], 2, tokenizer=CharTokenizer.train("abc"))
    theirs.save(tmp_path / "abc.npz")
    CharTokenizer.train("xyz").save(tmp_path / "xyz.json")
    proc = run_cli("eval", "--run", str(tmp_path / "abc.npz"), "--tokenizer", str(tmp_path / "xyz.json"),
                   "--corpus", str(corpus))
    assert proc.returncode == 2 and "was counted with another tokenizer" in proc.stderr
    # counting under torchrun
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")  # as torchrun sets it in every process it starts
        proc = run_cli("train", "--model", "ngram", *cli_flags(corpus, data_dir), "--out", str(tmp_path / "ddp"))
    assert proc.returncode == 2 and "run it without torchrun" in proc.stderr
    # the data of a run moved away
    moved = tmp_path / "moved-data"
    shutil.copytree(data_dir, moved)
    run = tmp_path / "moved-run"
    assert run_cli("train", "--model", "ngram", *cli_flags(corpus, moved), "--out", str(run)).returncode == 0
    shutil.rmtree(moved)
    proc = run_cli("eval", "--run", str(run))
    assert proc.returncode == 2 and "is not at" in proc.stderr and "--data-dir" in proc.stderr


def test_settings_a_family_does_not_read_are_named(tmp_path, corpus, data_dir):
    proc = run_cli("train", "--model", "ngram", *cli_flags(corpus, data_dir), "--out", str(tmp_path / "ng"))
    assert proc.returncode == 0, proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.startswith("tinylm: warning:")]
    # cli_flags sets network settings (layers, batch, lr, steps, ...): counting reads none of them
    assert len(warning) == 1 and "--n-layer" in warning[0] and "--lr" in warning[0] and "--corpus" not in warning[0]
    assert "do not apply to an n-gram model" in warning[0]


@pytest.mark.slow
def test_an_lstm_fine_tunes_with_another_bptt(tmp_path, runs, corpus, data_dir):
    proc = run_cli("train", "--init-from", str(runs["lstm"]), "--bptt", "4", *cli_flags(corpus, data_dir, max_steps=2),
                   "--out", str(tmp_path / "ft"))
    assert proc.returncode == 0, proc.stderr
    assert load_run(tmp_path / "ft").config.model.bptt == 4



@pytest.mark.slow
def test_corpora_that_are_not_utf8_read_with_errors_in_train_eval_and_compare(tmp_path, runs, corpus):
    """--errors (and --glob, --text-field) reach every command that reads a corpus, as in `tinylm prepare`."""
    folder = tmp_path / "latin1"
    folder.mkdir()
    (folder / "a.txt").write_bytes("The king rode out.\n".encode() * 40 + b"caf\xe9 au lait\n")  # Latin-1 é
    (folder / "b.md").write_bytes(b"my lord speak soft\n" * 40)
    data = tmp_path / "data"

    strict = run_cli("train", "--model", "ngram", "--order", "3", "--corpus", str(folder), "--data-dir", str(data),
                     "--tokenizer-kind", "char", "--out", str(tmp_path / "strict"))
    assert strict.returncode == 2 and "Traceback" not in strict.stderr
    assert strict.stderr.count("\n") == 1 and "byte 0xe9" in strict.stderr and "--errors replace" in strict.stderr
    assert not (tmp_path / "strict").exists()

    replaced = run_cli("train", "--model", "ngram", "--order", "3", "--corpus", str(folder), "--errors", "replace",
                       "--data-dir", str(data), "--tokenizer-kind", "char", "--val-fraction", "0.5",
                       "--out", str(tmp_path / "replaced"))
    assert replaced.returncode == 0, replaced.stderr
    tok = load_run(tmp_path / "replaced").tokenizer
    assert "\ufffd".encode() in {tok.token_bytes(i) for i in range(tok.vocab_size)}  # the bad byte became U+FFFD
    saved = (tmp_path / "replaced" / "config.toml").read_text()
    assert 'errors = "replace"' in saved

    # eval and compare: strict names the file, ignore drops the byte (so é's one byte counts as none)
    proc = run_cli("eval", "--run", str(runs["lstm"]), "--corpus", str(folder))
    assert proc.returncode == 2 and "a.txt is not valid UTF-8" in proc.stderr and proc.stderr.count("\n") == 1
    ignored = run_cli("eval", "--run", str(runs["lstm"]), "--corpus", str(folder), "--errors", "ignore")
    assert ignored.returncode == 0, ignored.stderr
    n = len(("The king rode out.\n" * 40 + "caf au lait\n").encode())
    assert f"{n + 1} tokens, {n} bytes" in ignored.stdout
    both = run_cli("eval", "--run", str(runs["lstm"]), "--corpus", str(folder), "--glob", "*.md")
    assert both.returncode == 0, both.stderr
    n = len(b"my lord speak soft\n" * 40)
    assert f"{n + 1} tokens, {n} bytes" in both.stdout
    compared = run_cli("compare", str(runs["lstm"]), str(runs["ngram"]), "--corpus", str(folder), "--errors",
                       "ignore", "--plot", str(tmp_path / "c.png"))
    assert compared.returncode == 0, compared.stderr
    assert (tmp_path / "c.png").exists()

    lonely = run_cli("eval", "--run", str(runs["lstm"]), "--errors", "replace")
    assert lonely.returncode == 2 and "give --corpus too" in lonely.stderr and lonely.stderr.count("\n") == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["word", "bpe"])
def test_shards_are_reused_when_the_corpus_cannot_fill_the_vocabulary(tmp_path, corpus, kind):
    """The test corpus has 33 distinct words: a word or BPE tokenizer asked for 4096 tokens gets fewer. The same
    command run again reuses the data folder (it used to refuse: "a tokenizer of 47 tokens, not the 4096 asked
    for"); asking for another size that the corpus could fill is still refused."""
    mine = shutil.copytree(corpus, tmp_path / "corpus")
    flags = ["--model", "ngram", "--order", "2", "--corpus", str(mine), "--tokenizer-kind", kind,
             "--data-dir", str(tmp_path / "data"), "--sample-tokens", "0"]
    first = run_cli("train", *flags, "--out", str(tmp_path / "one"))
    assert first.returncode == 0, first.stderr
    again = run_cli("train", *flags, "--out", str(tmp_path / "two"))
    assert again.returncode == 0, again.stderr
    assert "reused" in again.stdout and "warning" not in again.stderr  # said once, when the data was made
    assert load_run(tmp_path / "one").tokenizer.fingerprint() == load_run(tmp_path / "two").tokenizer.fingerprint()
    smaller = load_run(tmp_path / "one").tokenizer.vocab_size - 3
    other = run_cli("train", *flags, "--tokenizer-vocab-size", str(smaller), "--out", str(tmp_path / "three"))
    assert other.returncode == 2 and f"not the {kind} tokenizer of {smaller} asked for" in other.stderr
    with open(mine / "doc00.txt", "a", encoding="utf-8") as f:
        f.write("Zebras quietly juggle marmalade.\n")  # new words: the tokenizer trained now differs
    changed = run_cli("train", *flags, "--out", str(tmp_path / "four"))
    assert changed.returncode == 2 and "has the corpus changed?" in changed.stderr


def test_compare_names_runs_apart_when_their_folders_share_a_name(tmp_path, runs):
    from tinylm.compare import run_labels

    assert run_labels(["runs/a/m", "runs/b/m", "runs/c/other"]) == ["a/m", "b/m", "other"]
    assert run_labels(["x/same/m", "y/same/m"]) == ["x/same/m", "y/same/m"]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copytree(runs["ngram"], tmp_path / name / "m")
    proc = run_cli("compare", str(tmp_path / "a" / "m"), str(tmp_path / "b" / "m"), "--plot", str(tmp_path / "c.png"))
    assert proc.returncode == 0, proc.stderr
    assert "a/m " in proc.stdout and "b/m " in proc.stdout


def test_model_and_family_flags_must_agree_and_kn_nltk_order_is_checked_first(tmp_path, corpus, data_dir):
    clash = run_cli("train", "--model", "lstm", "--family", "gpt", *cli_flags(corpus, data_dir), "--out",
                    str(tmp_path / "x"))
    assert clash.returncode == 2 and "contradicts" in clash.stderr and not (tmp_path / "x").exists()
    agree = run_cli("train", "--model", "ngram", "--family", "ngram", "--order", "2", *cli_flags(corpus, data_dir),
                    "--out", str(tmp_path / "y"))
    assert agree.returncode == 0, agree.stderr
    early = run_cli("train", "--model", "ngram", "--order", "1", "--smoothing", "kn-nltk", "--corpus", "shakespeare",
                    "--out", str(tmp_path / "z"))
    assert early.returncode == 2 and "kn-nltk needs order 2" in early.stderr
    assert "tokenizer" not in early.stdout  # refused before any data was prepared


@pytest.mark.slow
def test_a_run_folders_ngram_file_finds_its_tokenizer_and_a_file_is_no_out_folder(tmp_path, runs, corpus, data_dir):
    text = tmp_path / "t.txt"
    text.write_text("The king rode out.\n", encoding="utf-8")
    bare = run_cli("eval", "--run", str(runs["ngram"] / "ngram.npz"), "--corpus", str(text))
    whole = run_cli("eval", "--run", str(runs["ngram"]), "--corpus", str(text))
    assert bare.returncode == 0 and whole.returncode == 0, bare.stderr + whole.stderr
    assert eval_numbers(bare.stdout) == eval_numbers(whole.stdout)
    lone = tmp_path / "lone.npz"
    shutil.copy(runs["ngram"] / "ngram.npz", lone)
    alone = run_cli("eval", "--run", str(lone), "--corpus", str(text))
    assert alone.returncode == 2 and "without a tokenizer" in alone.stderr

    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me", encoding="utf-8")
    for extra in ([], ["--force"]):
        proc = run_cli("train", *cli_flags(corpus, data_dir), "--out", str(a_file), *extra)
        assert proc.returncode == 2 and "is a file; a run is a folder" in proc.stderr
    for family in ("gpt", "ngram"):  # below a file: one line, not NotADirectoryError
        proc = run_cli("train", "--model", family, *cli_flags(corpus, data_dir), "--out", str(a_file / "sub"))
        assert proc.returncode == 2 and f"{a_file} is a file, not a folder" in proc.stderr, proc.stderr
    resumed = run_cli("train", "--out", str(a_file), "--resume")
    assert resumed.returncode == 2 and "is a file, not a run folder" in resumed.stderr
    assert a_file.read_text(encoding="utf-8") == "keep me"


@pytest.mark.slow
def test_eval_and_compare_print_json_for_scripts(tmp_path, runs):
    text = run_cli("eval", "--run", str(runs["lstm"]))
    as_json = run_cli("eval", "--run", str(runs["lstm"]), "--json")
    assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
    report = json.loads(as_json.stdout)
    loss, ppl, bpb = eval_numbers(text.stdout)
    assert round(report["loss"], 4) == loss and round(report["bits_per_byte"], 4) == bpb
    assert report["text"] == "val" and report["tokens"] > 0 and report["run"] == str(runs["lstm"])
    compared = run_cli("compare", *(str(runs[f]) for f in ("gpt", "ngram", "lstm")), "--json",
                       "--plot", str(tmp_path / "c.png"))
    assert compared.returncode == 0, compared.stderr
    table = json.loads(compared.stdout)
    assert [r["run"] for r in table["runs"]] == sorted(["gpt", "ngram", "lstm"], key=lambda n: next(
        r["bits_per_byte"] for r in table["runs"] if r["run"] == n))
    assert next(r for r in table["runs"] if r["run"] == "lstm")["loss"] == report["loss"]
    assert table["chart"] == str(tmp_path / "c.png") and (tmp_path / "c.png").exists()


def eval_json(capsys, *argv: str) -> dict:
    """`tinylm eval ... --json` in this process (the runs are tiny: no interpreter start per call)."""
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_eval_with_a_stride_scores_every_target_once_in_every_family(runs, data_dir, capsys):
    split = ShardSet.open(data_dir).meta["splits"]["val"]
    for family, out in runs.items():
        default = eval_json(capsys, "--run", str(out))
        sliding = eval_json(capsys, "--run", str(out), "--stride", "8")
        disjoint = eval_json(capsys, "--run", str(out), "--stride", "32")  # the block_size: the default exactly
        assert {**disjoint, "seconds": 0} == {**default, "seconds": 0}
        for report in (default, sliding):
            assert report["tokens"] == split["tokens"] and report["bytes"] == split["bytes"]
            assert not report["prorated"]
        if family == "ngram":  # no windows: the stride changes nothing, and the report says so
            assert default["windows"] == sliding["windows"] == "none" and sliding["stride"] is None
            assert sliding["loss"] == default["loss"]
        else:
            assert (default["windows"], default["block_size"], default["stride"]) == ("disjoint", 32, 32)
            assert (sliding["windows"], sliding["block_size"], sliding["stride"]) == ("sliding", 32, 8)
            assert sliding["loss"] != default["loss"] and math.isfinite(sliding["bits_per_byte"])
    capsys.readouterr()
    assert main(["eval", "--run", str(runs["lstm"]), "--stride", "8"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "on the val split (sliding windows of 32 tokens, stride 8): loss" in first


@pytest.mark.slow
def test_eval_and_compare_refuse_a_stride_outside_the_block_size_in_one_line(tmp_path, runs, capsys):
    proc = run_cli("eval", "--run", str(runs["gpt"]), "--stride", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"tinylm: error: stride 0 is out of range: give 1 to 32, the block_size of {runs['gpt']} "
        "(stride 32 is disjoint windows)"]
    chart = tmp_path / "c.png"
    for argv, needle in [
        (["eval", "--run", str(runs["rnn"]), "--stride", "33"], "stride 33 is out of range: give 1 to 32"),
        (["eval", str(runs["gpt"]), "--stride", "-1"], "stride -1 is out of range: give 1 to 32"),
        (["compare", str(runs["ngram"]), str(runs["gpt"]), "--stride", "40", "--plot", str(chart)],
         "stride 40 is out of range: give 1 to 32, the block_size of gpt"),
        (["eval", "--run", str(runs["ngram"]), "--stride", "0"], "stride 0 is out of range: give a positive integer"),
    ]:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert not chart.exists()  # refused before any run was evaluated
    with pytest.raises(SystemExit) as exit_info:  # not a number: argparse's one line
        main(["eval", "--run", str(runs["gpt"]), "--stride", "eight"])
    assert exit_info.value.code == 2 and "--stride: expected an integer, got 'eight'" in capsys.readouterr().err


def test_compare_with_a_stride_says_so_in_the_table_the_json_and_the_chart(tmp_path, runs, capsys, monkeypatch):
    import tinylm.explain.plots as plots

    titles = []
    draw = plots.plot_bits_per_byte

    def titled(*args, title=None):
        titles.append(title)
        return draw(*args, title=title)

    monkeypatch.setattr(plots, "plot_bits_per_byte", titled)
    chart = str(tmp_path / "c.png")
    names = [str(runs[f]) for f in ("gpt", "ngram", "lstm")]
    capsys.readouterr()
    assert main(["compare", *names, "--plot", chart]) == 0
    assert "windows: disjoint, each network's block_size long" in capsys.readouterr().out
    assert main(["compare", *names, "--stride", "8", "--plot", chart]) == 0
    table = capsys.readouterr().out
    assert "windows: sliding, each network's block_size long, stride 8 (every target scored once, with at least " \
           "block_size - 7 tokens of context after the first window); n-gram models read their own context" in table
    assert main(["compare", *names, "--stride", "8", "--plot", chart, "--json"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert {name: (r["windows"], r["stride"]) for name, r in rows.items()} == {
        "gpt": ("sliding", 8), "lstm": ("sliding", 8), "ngram": ("none", None)}
    assert rows["lstm"]["loss"] == eval_json(capsys, "--run", str(runs["lstm"]), "--stride", "8")["loss"]
    assert titles == ["bits per byte on the val split (disjoint windows)"] + \
        ["bits per byte on the val split (sliding windows, stride 8)"] * 2


def test_compare_draws_beside_the_runs_and_eval_picks_the_device_as_train_does(tmp_path, runs, monkeypatch, capsys):
    """Without --plot the chart goes beside the runs (runs/compare.png, which git ignores), not into the
    folder the command runs in; and eval's and compare's --device default is train's: auto."""
    monkeypatch.chdir(tmp_path)
    assert main(["compare", str(runs["ngram"]), "--tokens", "256"]) == 0
    chart = runs["ngram"].parent / "compare.png"
    assert f"chart: {chart}" in capsys.readouterr().out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "compare.png").exists()
    chart.unlink()
    from tinylm.cli import build_parser
    from tinylm.config import resolve_config

    for argv in (["eval", "--run", "r"], ["compare", "r"]):
        assert build_parser().parse_args(argv).device == resolve_config().train.device == "auto"
