"""Configuration: GPTConfig validation, the presets, TOML files, `--key value` overrides and their errors."""

from __future__ import annotations

import pytest
import torch

from tinylm.config import (
    Config,
    GPTConfig,
    apply_overrides,
    build_config,
    dump_toml,
    list_presets,
    load_config_file,
    load_preset,
    resolve_config,
)
from tinylm.errors import TinyLMError
from tinylm.explain.accounting import count_params
from tinylm.model import build_model


def meta_param_count(config: GPTConfig) -> int:
    with torch.device("meta"):  # shapes only: builds GPT-2 in milliseconds without allocating 500 MB
        model = build_model(config)
    return sum(p.numel() for p in model.parameters())


def test_the_promised_presets_exist():
    assert {"tiny", "classic", "small", "medium", "gpt2-124m", "llama", "lstm", "rnn"} <= set(list_presets())


@pytest.mark.parametrize("family", ["lstm", "rnn"])
def test_the_recurrent_presets_are_the_classic_run_with_a_recurrent_model(family):
    classic, rec = resolve_config(preset="classic"), resolve_config(preset=family)
    assert (rec.model.family, rec.model.n_layer, rec.model.d_model, rec.train.lr) == (family, 2, 256, 1e-2)
    # the same data, budget and optimizer as the classic run, where their benchmark figures were measured
    for key in ("corpus", "tokenizer_kind", "tokenizer_vocab_size", "batch_size", "max_tokens", "optimizer", "decay"):
        assert getattr(rec.train, key) == getattr(classic.train, key)
    assert rec.model.block_size == classic.model.block_size and rec.train.optimizer == "adamw"


def test_classic_is_the_former_default_run_exactly():
    # what `tinylm train` ran before the modern recipe: tiny's shape, AdamW and a cosine schedule, float32
    classic = resolve_config(preset="classic")
    m, t = classic.model, classic.train
    assert (m.n_layer, m.d_model, m.n_head, m.block_size, m.mlp, m.norm, m.positions, m.tie_embeddings) == (
        4, 192, 6, 128, "swiglu", "rmsnorm", "rope", True)
    assert not (m.qk_norm or m.value_embed or m.bigram_hash or m.zero_init_projections) and m.logit_softcap is None
    assert (t.tokenizer_vocab_size, t.batch_size, t.max_tokens, t.optimizer, t.lr, t.warmup_steps, t.decay,
            t.dtype) == (4096, 16, 1_500_000, "adamw", 3e-3, 20, "cosine", "float32")
    assert t.final_lr == pytest.approx(3e-4)  # lr / 10


def test_tiny_runs_the_modern_recipe_on_classics_model_and_corpus():
    tiny, classic = resolve_config(preset="tiny"), resolve_config(preset="classic")
    assert (tiny.train.optimizer, tiny.train.decay, tiny.model.qk_norm, tiny.model.tie_embeddings) == (
        "muon", "wsd", True, False)
    for key in ("n_layer", "d_model", "n_head", "mlp", "norm", "positions"):
        assert getattr(tiny.model, key) == getattr(classic.model, key)
    # a context of 512, trained mostly on classic's windows of 128 (the sequence-length schedule), with the
    # same tokens a step in either phase
    assert (tiny.model.block_size, tiny.train.short_block_size, classic.model.block_size) == (512, 128, 128)
    assert tiny.train.batch_size * tiny.model.block_size == 32 * 128
    # the same corpus, and a budget that takes no longer: tiny trains 1.13-1.15x classic's tokens/s on a
    # CPU with bfloat16 (benchmarks/recipe.py measures both side by side), so its budget is 1.7M to 1.5M
    assert tiny.train.corpus == classic.train.corpus
    assert classic.train.max_tokens <= tiny.train.max_tokens <= 1.15 * classic.train.max_tokens


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_and_builds(name):
    config = resolve_config(preset=name).model
    assert meta_param_count(config) == count_params(config)


def test_gpt2_124m_is_gpt2_small():
    config = resolve_config(preset="gpt2-124m").model
    assert (config.n_layer, config.n_head, config.d_model, config.block_size, config.vocab_size) == (12, 12, 768, 1024, 50257)
    choices = (config.positions, config.norm, config.mlp, config.bias, config.tie_embeddings)
    assert choices == ("learned", "layernorm", "gelu", True, True)
    assert meta_param_count(config) == 124_439_808  # the well-known count of Hugging Face's "gpt2"
    assert config == GPTConfig()  # the dataclass defaults are GPT-2 small


def test_llama_preset_is_llama_shaped():
    config = resolve_config(preset="llama").model
    choices = (config.positions, config.norm, config.mlp, config.bias, config.tie_embeddings)
    assert choices == ("rope", "rmsnorm", "swiglu", False, False)
    assert config.kv_heads < config.n_head


def test_tiny_preset_is_the_modern_cpu_default():
    config = resolve_config(preset="tiny").model
    assert (config.positions, config.norm, config.mlp) == ("rope", "rmsnorm", "swiglu")
    assert config.n_layer <= 6 and config.d_model <= 256


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"d_model": 130, "n_head": 4}, r"d_model \(130\) must be divisible by n_head \(4\).*use n_head in \[1, 2, 5, 10"),
        ({"n_head": 8, "n_kv_head": 3, "d_model": 64}, r"n_kv_head \(3\) must divide n_head \(8\).*\[1, 2, 4, 8\]"),
        ({"positions": "rope", "d_model": 28, "n_head": 4}, r"head size .* must be even; it is 28 / 4 = 7"),
        ({"positions": "sinusoidal", "d_model": 27, "n_head": 3}, "d_model must be even"),
        ({"attention": "flash"}, r"attention must be one of 'sdpa', 'reference', 'tiled'; got 'flash'"),
        ({"norm": "batchnorm"}, "norm must be one of 'layernorm', 'rmsnorm'"),
        ({"positions": "alibi"}, "positions must be one of"),
        ({"n_layer": 0}, "n_layer must be a positive integer, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a positive integer"),
        ({"n_kv_head": 0}, "n_kv_head must be a positive integer"),
        ({"dropout": 1.0}, r"dropout is a probability in \[0, 1\)"),
        ({"init_std": 0.0}, "init_std must be positive"),
        ({"n_layer": "4"}, r"n_layer expects an integer, got '4' \(str\)"),
        ({"bias": 1}, "bias expects true or false"),
    ],
)
def test_impossible_configurations_say_what_to_change(changes, message):
    with pytest.raises(TinyLMError, match=message):
        GPTConfig(**changes)


def test_hidden_width_rules():
    assert GPTConfig(d_model=192, n_head=6, mlp="gelu").hidden_dim == 768
    assert GPTConfig(d_model=192, n_head=6, mlp="swiglu").hidden_dim == 512  # 8/3 * 192
    assert GPTConfig(d_model=512, n_head=8, mlp="swiglu").hidden_dim == 1408  # 1365.3 rounded up to 64s
    assert GPTConfig(d_model=512, n_head=8, mlp="swiglu", d_ff=1000).hidden_dim == 1000


def test_overrides_command_line_style():
    preset = load_preset("tiny")
    cfg = apply_overrides(preset, ["--n-layer", "6", "--positions=learned", "--no-tie-embeddings",
                                                 "--bias", "--model.dropout", "0.1", "--n_kv_head", "2",
                                                 "--rope-theta", "500000"])
    model = build_config(cfg).model
    assert (model.n_layer, model.positions, model.tie_embeddings, model.bias, model.dropout) == (6, "learned", False, True, 0.1)
    assert model.kv_heads == 2 and model.rope_theta == 500000.0
    assert model.d_model == 192  # untouched settings keep the preset's values
    assert preset == load_preset("tiny")  # the input is not modified


def test_overrides_as_a_dict_and_back_to_the_default_rule():
    cfg = apply_overrides({"model": {"n_kv_head": 2, "n_head": 4, "d_model": 64}}, {"model.n_kv_head": "none", "d_ff": 100})
    assert build_config(cfg).model.kv_heads == 4
    assert build_config(cfg).model.hidden_dim == 100


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--n-layr", "4"],
         r"unknown setting --n-layr \(did you mean '--n-layer'\?\); the valid settings are: --family, --vocab-size, --block-size"),
        (["--n-layer", "four"], r"--n-layer expects an integer, got 'four'"),
        (["--dropout", "lots"], "--dropout expects a number"),
        (["--bias", "maybe"], "--bias expects true or false"),
        (["--mlp", "relu"], "mlp must be one of 'gelu', 'swiglu', 'relu2', 'geglu'; got 'relu'"),
        (["--n-layer"], r"--n-layer needs a value"),
        (["n-layer", "4"], "expected a setting such as --n-layer"),
        (["--modle.n-layer", "1"], "unknown table 'modle'"),
        ({"n_layer": 4.5}, r"--n-layer expects an integer, got 4.5 \(float\)"),
    ],
)
def test_bad_overrides_say_what_was_expected(overrides, message):
    with pytest.raises(TinyLMError, match=message):
        apply_overrides(load_preset("tiny"), overrides)


def test_a_config_file_over_a_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('preset = "tiny"\n\n[model]\nn_layer = 2\nnorm_eps = 1e-6\n')
    config = resolve_config(path=path, overrides=["--d-model", "96"]).model
    assert (config.n_layer, config.norm_eps, config.d_model, config.positions) == (2, 1e-6, 96, "rope")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[model]\nn_layers = 2\n",
         r"unknown key 'n_layers' in \[model\] \(did you mean 'n_layer'\?\); the valid keys are: family, vocab_size"),
        ("[model]\nn_layer = \"2\"\n", r"model.n_layer expects an integer, got '2' \(str\)"),
        ("[modle]\nn_layer = 2\n", r"unexpected table \[modle\]; a configuration has the tables \[model\]"),
        ("n_layer = 2\n", r"unexpected key 'n_layer'"),
        ("preset = \"tinny\"\n", r"unknown preset 'tinny' \(did you mean 'tiny'\?\)"),
        ("[model\n", "is not valid TOML"),
    ],
)
def test_bad_config_files_say_what_was_expected(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TinyLMError, match=message):
        load_config_file(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(TinyLMError, match="configuration file not found"):
        load_config_file(tmp_path / "nope.toml")


@pytest.mark.parametrize("name", list_presets())
def test_the_resolved_config_round_trips_through_toml(tmp_path, name):
    overrides = {"dropout": 0.1, "norm_eps": 1e-6}
    if name in ("lstm", "rnn"):  # a recurrent network has no norm: resolving says so
        with pytest.warns(UserWarning, match=r"--norm-eps does not apply to an (LSTM|RNN) model and is ignored"):
            config = resolve_config(preset=name, overrides=overrides)
    else:
        config = resolve_config(preset=name, overrides=overrides)
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(config.to_dict()))
    assert build_config(load_config_file(path)) == config
    assert isinstance(config, Config)


def _command_config(capsys, *argv: str) -> Config:
    """The configuration `tinylm train ARGV` would train with (what --print-config prints)."""
    import tomllib

    from tinylm.cli import main

    assert main(["train", *argv, "--print-config"]) == 0
    return build_config(tomllib.loads(capsys.readouterr().out))


@pytest.mark.parametrize("family, preset", [("lstm", "lstm"), ("rnn", "rnn"), ("gpt", "tiny"), ("ngram", "tiny")])
def test_the_model_flag_alone_starts_from_its_family_s_preset(capsys, family, preset):
    from tinylm.config import default_run_dir

    config = _command_config(capsys, "--model", family)
    expected = resolve_config(preset=preset, overrides={"family": family})
    assert (config.model, config.train) == (expected.model, expected.train)
    assert resolve_config(overrides={"family": family}) == config  # Python starts where the command does
    assert default_run_dir(overrides={"family": family}).name == f"{'tiny' if family == 'gpt' else family}-shakespeare"
    flagged = _command_config(capsys, "--model", family, "--warmup-steps", "7")
    assert flagged.train.warmup_steps == 7 and flagged.model == expected.model  # flags still override the preset


def test_naming_the_family_changes_neither_fine_tuning_settings_nor_the_folder_twice(tmp_path, capsys):
    """`--model rnn --init-from RUN` fine-tunes with tiny's [train] settings, as `--init-from RUN` does; and
    `--model rnn --preset rnn` is runs/rnn-shakespeare, not runs/rnn-rnn-shakespeare."""
    from tinylm.config import default_run_dir

    source = tmp_path / "r2"
    source.mkdir()
    (source / "config.toml").write_text(dump_toml(resolve_config(preset="rnn").to_dict()), encoding="utf-8")
    named = _command_config(capsys, "--model", "rnn", "--init-from", str(source))
    unnamed = _command_config(capsys, "--init-from", str(source))
    assert named.train == unnamed.train == resolve_config(preset="tiny").train
    assert named.model == unnamed.model and named.model.family == "rnn"
    assert resolve_config(overrides={"family": "rnn"}, init_from=source) == named
    assert default_run_dir(preset="rnn", overrides={"family": "rnn"}).name == "rnn-shakespeare"


def test_lr_alone_is_refused_where_another_group_keeps_its_own_rate(capsys, tmp_path):
    """Under tiny's Muon, `--lr` is the AdamW groups' rate only: given alone, it would leave the matrices at
    muon_lr and the head at head_lr. It is refused in one line naming the flags (and keys) to set too; with
    them every group's rate is the one given, and where no group keeps its own rate `--lr` alone is fine."""
    from tinylm.cli import main

    assert main(["train", "--lr", "2e-3", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--muon-lr" in err[0] and "--head-lr" in err[0] and "muon_lr" in err[0], err
    with pytest.raises(TinyLMError, match="head_lr 0.005 .--head-lr."):  # a Python caller reads the key too
        resolve_config(overrides={"lr": 2e-3, "muon_lr": 2e-3})
    mine = tmp_path / "mine.toml"  # the caller's own file is the caller's setting, as a flag is
    mine.write_text("[train]\nlr = 2e-3\n")
    with pytest.raises(TinyLMError, match="muon_lr"):
        resolve_config(path=mine)
    every = _command_config(capsys, "--lr", "2e-3", "--muon-lr", "2e-3", "--head-lr", "2e-3")
    assert every.train.lr == every.train.muon_lr == every.train.head_lr == 2e-3
    sgd = _command_config(capsys, "--optimizer", "sgd", "--lr", "0.1", "--head-lr", "0.1")
    assert sgd.train.lr == sgd.train.head_lr == 0.1
    assert resolve_config(preset="classic", overrides={"lr": 1e-3}).train.lr == 1e-3  # AdamW, one rate: fine
