"""End-to-end runs of the `tinylm` command: the real entry point, real files, real exit codes."""

import argparse
import inspect
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tinylm.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"

CORPUS_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
) * 20


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed command exactly as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "tinylm", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS_TEXT, encoding="utf-8")
    return path


@pytest.fixture
def bpe_file(tmp_path, corpus_file):
    out = tmp_path / "tok.json"
    assert main(["tokenizer", "train", "--corpus", str(corpus_file), "--vocab-size", "300", "--out", str(out)]) == 0
    return out


def test_every_readme_command_parses():
    """The README tour is the documentation: every `tinylm ...` line in it must still parse."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    commands = [line for line in lines if line.startswith("tinylm ")]
    assert len(commands) >= 8
    parser = build_parser()
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])  # raises SystemExit on a renamed flag


def test_help_pages(capsys):
    for argv in (["--help"], ["tokenizer", "--help"], ["tokenizer", "train", "--help"], ["prepare", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
    assert "--vocab-size" in capsys.readouterr().out


def _commands(parser, words=()):
    """Every command under ``parser``, as (its words, its parser), groups included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*words, name), sub
                yield from _commands(sub, (*words, name))


def test_every_command_describes_itself_with_its_functions_docstring():
    """`tinylm X --help` prints the docstring of the function that runs X, so the two cannot drift apart."""
    commands = list(_commands(build_parser()))
    assert len(commands) >= 20
    for words, parser in commands:
        func = parser.get_default("func")
        if func.__name__ == "show":  # a group (`tinylm tokenizer`): its help lists its commands
            assert parser.description, words
            continue
        assert func.__doc__ and parser.description == inspect.getdoc(func), words
        assert parser.get_default("parser") is parser, words


def test_tokenizer_train_encode_decode_info(tmp_path, corpus_file, bpe_file, capsys):
    capsys.readouterr()
    text = "Speak, speak. You are all resolved"
    assert main(["tokenizer", "encode", "--tokenizer", str(bpe_file), "--text", text]) == 0
    ids = capsys.readouterr().out.split()
    assert main(["tokenizer", "decode", "--tokenizer", str(bpe_file), *ids]) == 0
    assert capsys.readouterr().out == text

    assert main(["tokenizer", "encode", "--tokenizer", str(bpe_file), "--file", str(corpus_file), "--count"]) == 0
    count = capsys.readouterr().out
    n_tokens = int(count.split()[0])
    assert f"{len(CORPUS_TEXT.encode())} bytes" in count
    assert 0 < n_tokens < len(CORPUS_TEXT)  # the merges compress the text they were trained on

    assert main(["tokenizer", "encode", "--tokenizer", str(bpe_file), "--text", "Speak", "--show"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert "".join(eval(line.split(None, 1)[1]) for line in shown) == "Speak"

    assert main(["tokenizer", "info", "--tokenizer", str(bpe_file), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "bpe" and info["vocab_size"] == 300 and info["pattern"] == "gpt4"
    assert info["merges"] == 300 - 256 - 3


def test_encode_reads_stdin_and_respects_special_tokens(bpe_file):
    plain = run("tokenizer", "encode", "--tokenizer", str(bpe_file), stdin="a<|eos|>")
    allowed = run("tokenizer", "encode", "--tokenizer", str(bpe_file), "--allow-special", stdin="a<|eos|>")
    assert plain.returncode == 0 and allowed.returncode == 0
    info = json.loads(run("tokenizer", "info", "--tokenizer", str(bpe_file), "--json").stdout)
    eos = str(info["special_tokens"]["<|eos|>"])
    assert eos not in plain.stdout.split()
    assert allowed.stdout.split()[-1] == eos


@pytest.mark.parametrize("kind", ["char", "word"])
def test_train_char_and_word(tmp_path, corpus_file, kind, capsys):
    out = tmp_path / f"{kind}.json"
    assert main(["tokenizer", "train", "--corpus", str(corpus_file), "--kind", kind, "--vocab-size", "40", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "--text", "Speak, speak."]) == 0
    ids = capsys.readouterr().out.split()
    assert main(["tokenizer", "decode", "--tokenizer", str(out), *ids]) == 0
    assert capsys.readouterr().out == "Speak, speak."


USER_ERRORS = [
    (["tokenizer", "train", "--corpus", "/no/such/dir", "--out", "x.json"], "/no/such/dir"),
    (["tokenizer", "train", "--corpus", "shakspeare", "--out", "x.json"], "shakspeare"),
    (["tokenizer", "train", "--vocab-size", "lots", "--out", "x.json"], "--vocab-size"),
    (["tokenizer", "train", "--vocab-size", "0", "--out", "x.json"], "positive integer"),
    (["tokenizer", "encode", "--tokenizer", "/no/tok.json", "--text", "x"], "does not exist"),
    (["tokenizer", "decode", "--tokenizer", "/no/tok.json", "1"], "does not exist"),
    (["prepare", "--val-fraction", "2", "--out", "x"], "between 0 and 1"),
    (["frobnicate"], "invalid choice"),
    # a negative seed: numpy's SeedSequence used to raise after the data was prepared
    (["train", "--seed", "-1", "--max-steps", "1"], "seed must be an integer from 0 to 2**63 - 1, got -1"),
    (["prepare", "--seed", "-1", "--out", "x"], "--seed: expected an integer from 0 to 2**63 - 1, got -1"),
    (["sample", "runs/x", "--seed", "-5"], "--seed: expected an integer from 0 to 2**63 - 1, got -5"),
]


@pytest.mark.parametrize("argv,needle", USER_ERRORS)
def test_user_errors_are_one_line_exit_2_no_traceback(tmp_path, argv, needle):
    result = subprocess.run(
        [sys.executable, "-m", "tinylm", *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]


def test_bad_token_id_and_existing_output(tmp_path, corpus_file, bpe_file):
    result = run("tokenizer", "decode", "--tokenizer", str(bpe_file), "99999")
    assert result.returncode == 2 and "outside this tokenizer's vocabulary" in result.stderr
    result = run("tokenizer", "decode", "--tokenizer", str(bpe_file), "12x")
    assert result.returncode == 2 and "'12x'" in result.stderr
    # an existing output file is never overwritten without --force
    before = bpe_file.read_bytes()
    result = run("tokenizer", "train", "--corpus", str(corpus_file), "--kind", "char", "--out", str(bpe_file))
    assert result.returncode == 2 and "--force" in result.stderr
    assert bpe_file.read_bytes() == before


def test_console_script_entry_point():
    """`tinylm` is installed as a console script pointing at the same main()."""
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "tinylm"]
    assert ep.value == "tinylm.cli:main"


def test_an_unknown_flag_points_at_its_own_subcommand_help():
    proc = subprocess.run([sys.executable, "-m", "tinylm", "train", "--tie-embeddings", "false"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tinylm train: error: unrecognized arguments: false (see `tinylm train --help`)"


def test_a_config_file_without_a_preset_starts_from_tiny_as_the_command_does(tmp_path):
    import tomllib

    from tinylm.config import dump_toml, resolve_config

    plain = tmp_path / "my-run.toml"
    plain.write_text("[train]\nwarmup_steps = 7\n")
    done = run("train", "--config", str(plain), "--print-config")
    assert done.returncode == 0, done.stderr
    printed = tomllib.loads(done.stdout)
    expected = resolve_config(preset="tiny", overrides={"warmup_steps": 7}).to_dict()
    assert printed == tomllib.loads(dump_toml(expected))
    assert printed["model"]["n_layer"] == 4 and printed["model"]["d_model"] == 192  # tiny's, not GPT-2 small's
    # a preset named in the file, on the command line, or by --model wins over tiny
    named = tmp_path / "small-run.toml"
    named.write_text('preset = "small"\n[train]\nwarmup_steps = 7\n')
    for argv, preset in ((["--config", str(named)], "small"), (["--config", str(plain), "--preset", "classic"], "classic"),
                         (["--config", str(plain), "--model", "lstm"], "lstm")):
        done = run("train", *argv, "--print-config")
        assert done.returncode == 0, done.stderr
        assert tomllib.loads(done.stdout) == tomllib.loads(dump_toml(resolve_config(preset=preset, overrides={"warmup_steps": 7}).to_dict())), argv



def test_tying_the_default_runs_head_drops_the_presets_zero_init_of_its_untied_head(tmp_path):
    import tomllib

    from tinylm.config import resolve_config

    # tiny starts its untied head at zero (head_init_std = 0); --tie-embeddings makes the head E itself
    done = run("train", "--tie-embeddings", "--print-config")
    assert done.returncode == 0, done.stderr
    model = tomllib.loads(done.stdout)["model"]
    assert model["tie_embeddings"] is True and "head_init_std" not in model
    assert resolve_config(preset="tiny", overrides={"tie_embeddings": True}).model.head_init_std is None
    mine = tmp_path / "tied.toml"
    mine.write_text("[model]\ntie_embeddings = true\n")
    assert resolve_config(preset="tiny", path=mine).model.head_init_std is None
    named = tmp_path / "tied-tiny.toml"  # the file names tiny itself: tiny's zero head is still not the user's
    named.write_text('preset = "tiny"\n[model]\ntie_embeddings = true\n')
    assert resolve_config(path=named).model.head_init_std is None
    done = run("train", "--config", str(named), "--print-config")
    assert done.returncode == 0 and "head_init_std" not in tomllib.loads(done.stdout)["model"], done.stderr
    # both asked for by the user: a contradiction, said in one line
    done = run("train", "--tie-embeddings", "--head-init-std", "0.02", "--print-config")
    assert done.returncode == 2 and "head_init_std initialises an untied output head" in done.stderr
    assert "Traceback" not in done.stderr

# ----- corpora in other encodings, and where prepare puts them ------------------------------------

LATIN1_TEXT = "Le café du roi, the king's coffee.\n" * 30


def _decoded_shards(folder: Path) -> str:
    """The text a prepared folder holds: both splits' tokens decoded, end-of-document tokens left out."""
    from tinylm.data import ShardSet

    shards = ShardSet.open(folder)
    tok = shards.tokenizer()
    return "".join(tok.decode([int(i) for i in shards.tokens(split) if i != tok.eos_id]) for split in ("train", "val"))


def test_prepare_reads_a_latin1_file_with_encoding(tmp_path):
    path = tmp_path / "old.txt"
    path.write_bytes(LATIN1_TEXT.encode("latin-1"))
    out = tmp_path / "data"
    done = run("prepare", "--corpus", str(path), "--encoding", "latin-1", "--kind", "char", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert _decoded_shards(out) == LATIN1_TEXT  # the é is there, not U+FFFD and not dropped
    # without it: one line that names the byte and the way out
    failed = run("prepare", "--corpus", str(path), "--kind", "char", "--out", str(tmp_path / "utf8"))
    assert failed.returncode == 2 and "Traceback" not in failed.stderr and failed.stderr.count("\n") == 1
    assert "old.txt is not valid UTF-8: byte 0xe9 at byte offset 6" in failed.stderr
    assert "--encoding latin-1" in failed.stderr


def test_prepare_reads_a_cp1252_jsonl_into_a_folder_named_by_its_stem(tmp_path):
    text = "\u201cFive \u20ac,\u201d said the clerk \u2013 twice.\n"
    lines = "".join(json.dumps({"body": text * 8, "id": i}, ensure_ascii=False) + "\n" for i in range(6))
    (tmp_path / "docs.jsonl").write_bytes(lines.encode("cp1252"))  # the quotes and the euro as single bytes
    done = subprocess.run([sys.executable, "-m", "tinylm", "prepare", "--corpus", "docs.jsonl", "--text-field", "body",
                           "--encoding", "cp1252", "--kind", "char"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["docs"]  # not data/docs.jsonl
    assert _decoded_shards(tmp_path / "data" / "docs").count(text) == 6 * 8


@pytest.mark.parametrize("corpus, folder", [("docs.jsonl", "docs"), ("notes/", "notes"), ("play.txt", "play")])
def test_prepare_names_its_folder_by_the_corpus_stem(tmp_path, corpus, folder):
    """As `tinylm train` names data/docs-bpe-2048: data/docs for docs.jsonl, not data/docs.jsonl."""
    (tmp_path / "notes").mkdir()
    for i in range(4):
        (tmp_path / "notes" / f"{i}.txt").write_text(CORPUS_TEXT)
    (tmp_path / "play.txt").write_text(CORPUS_TEXT)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": CORPUS_TEXT}) + "\n" for _ in range(4)))
    done = subprocess.run([sys.executable, "-m", "tinylm", "prepare", "--corpus", corpus, "--kind", "char"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (tmp_path / "data").iterdir()] == [folder]
    assert (tmp_path / "data" / folder / "meta.json").is_file()


@pytest.mark.parametrize("command", [["prepare"], ["tokenizer", "train", "--out", "t.json"],
                                     ["train", "--model", "ngram", "--max-steps", "1"]])
def test_an_unknown_encoding_is_one_line(tmp_path, command):
    (tmp_path / "a.txt").write_text(CORPUS_TEXT)
    proc = subprocess.run([sys.executable, "-m", "tinylm", *command, "--corpus", "a.txt", "--encoding", "latin-l"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("tinylm: error: unknown encoding 'latin-l': not a text encoding Python knows; "
                                   "give a codec name such as utf-8, latin-1 or cp1252")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]  # nothing written


def test_train_reads_its_corpus_in_the_encoding_of_its_config(tmp_path):
    """[train] encoding reaches the corpus that training prepares (a counted model: no network to train)."""
    (tmp_path / "old.txt").write_bytes(LATIN1_TEXT.encode("latin-1"))
    (tmp_path / "run.toml").write_text('[train]\ncorpus = "old.txt"\nencoding = "latin-1"\ntokenizer_kind = "char"\n')
    proc = subprocess.run([sys.executable, "-m", "tinylm", "train", "--config", "run.toml", "--model", "ngram",
                           "--order", "2", "--out", "runs/old"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr  # --encoding is a setting the counted model reads too
    assert 'encoding = "latin-1"' in (tmp_path / "runs" / "old" / "config.toml").read_text()
    data = tmp_path / "data" / "old-char"
    assert _decoded_shards(data) == LATIN1_TEXT


@pytest.mark.parametrize("argv", [["eval"], ["export", "--format", "hf", "--out", "o"], ["serve"], ["sample"],
                                  ["next-token", "--prompt", "x"]])
def test_every_command_that_loads_a_run_spells_the_run_and_its_checkpoint_alike(argv, capsys):
    parser = build_parser()
    args = parser.parse_args([*argv, "--run", "runs/x"])
    assert "runs/x" in (args.run, getattr(args, "run_flag", None)) and args.checkpoint == "best"
    assert parser.parse_args([*argv, "--run", "runs/x", "--checkpoint", "latest"]).checkpoint == "latest"
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--run", "runs/x", "--checkpoint", "newest"])
    err = capsys.readouterr().err
    assert "invalid choice" in err and "newest" in err and "best" in err and "latest" in err


def test_a_mistyped_flag_gets_the_closest_one_and_the_help_names_every_command(capsys):
    for argv, hint in ((["train", "--max-step", "3"], "(did you mean '--max-steps'?)"),
                       (["sample", "--run", "r", "--temprature=1"], "(did you mean '--temperature'?)")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and hint in err[0], err
    with pytest.raises(SystemExit):
        main(["train", "--zzzzzz", "1"])
    assert "did you mean" not in capsys.readouterr().err  # nothing close: no guess
    description = build_parser().description  # the summary at the top of `tinylm --help`
    for command in ("train", "compare", "sample", "serve", "export", "import", "explain"):
        assert command in description, command
