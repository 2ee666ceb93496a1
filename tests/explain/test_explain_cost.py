"""`tinylm explain cost`: the accounting against built models of every preset, FLOPs against torch's own
counter, the one-attention-layer numbers worked by hand, the picture, and bad input through the real command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread
from torch.utils.flop_counter import FlopCounterMode

from tinylm.config import GPTConfig, list_presets, resolve_config
from tinylm.errors import TinyLMError
from tinylm.explain.accounting import count_params, kv_cache_bytes
from tinylm.explain.cost import cost_report, format_cost, plot_cost
from tinylm.model import build_model


def explain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinylm", "explain", *args], capture_output=True, text=True)


@pytest.mark.parametrize("preset", list_presets())
def test_the_count_is_the_built_model_s_for_every_preset(preset):
    config = resolve_config(preset=preset).model
    if config.family == "ngram":
        pytest.skip("an n-gram model has counts, not parameters")
    with torch.device("meta"):  # the shapes without the memory: gpt2-124m builds in no time
        model = build_model(config)
    assert count_params(config) == sum(p.numel() for p in model.parameters())  # a tied matrix is counted once
    if config.family == "gpt":
        report = cost_report(config)
        assert report["params"]["total"] == count_params(config)
        assert (report["params"]["lm_head"] == 0) == config.tie_embeddings


@pytest.mark.parametrize("family", ["lstm", "rnn"])
def test_the_recurrent_families_are_counted_too(family):
    config = resolve_config(preset="tiny", overrides={"model.family": family}).model
    with torch.device("meta"):
        model = build_model(config)
    assert count_params(config) == sum(p.numel() for p in model.parameters())
    with pytest.raises(TinyLMError, match="the Transformer's"):
        cost_report(config)


def small_config(**changes) -> GPTConfig:
    base = GPTConfig(vocab_size=97, block_size=24, n_layer=2, d_model=32, n_head=4, n_kv_head=2, mlp="swiglu",
                     attention="reference", tie_embeddings=False)
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("changes", [{}, {"mlp": "gelu", "n_kv_head": None, "tie_embeddings": True}])
def test_flops_match_torch_s_flop_counter_on_a_forward_pass_and_a_training_step(changes):
    config = small_config(**changes)
    torch.manual_seed(0)
    model = build_model(config)
    B, T = 2, config.block_size
    idx = torch.randint(0, config.vocab_size, (B, T))
    flops = cost_report(config)["flops_per_token"]
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)
    assert counter.get_total_flops() == B * T * flops["forward"]
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, idx)
        loss.backward()
    assert counter.get_total_flops() == B * T * flops["training"]  # backward = 2x forward, weight by weight


def test_one_attention_layer_of_512_with_8_heads():
    report = cost_report(GPTConfig(n_layer=1, d_model=512, n_head=8, bias=False, qk_norm=False))
    assert report["attention_layer_weights"] == report["attention_layer_params"] == 1_048_576
    T = report["context"]
    assert report["inner_products"]["per_sequence"] == 8 * T * T
    assert report["inner_products"]["doubled_context"] == 4 * report["inner_products"]["per_sequence"]


def test_kv_cache_and_activations():
    config = small_config()
    kv = kv_cache_bytes(config)
    assert kv["per_token"] == 2 * 2 * 2 * 8 * 4  # k and v, 2 layers, 2 kv heads of 8, float32
    assert kv["full_context"] == kv["per_token"] * 24
    one, two = (cost_report(config, batch_size=b)["activation_bytes"] for b in (1, 2))
    assert two["total"] == 2 * one["total"]  # linear in the batch
    long = cost_report(config, seq_len=48)["activation_bytes"]
    assert long["attention_scores"] == 4 * one["attention_scores"]  # the T^2 term
    assert "KV cache (float32): 256 B per token" in format_cost(cost_report(config))


def test_the_picture(tmp_path):
    image = imread(plot_cost(small_config(), tmp_path / "cost.png"))
    assert image.shape[:2] == (round(4.2 * 110), 7 * 110) and image[..., :3].std() > 0.05


@pytest.mark.slow
def test_the_command_prints_the_worked_numbers(tmp_path):
    out = explain("cost", "--n-layer", "1", "--d-model", "512", "--n-head", "8", "--out", str(tmp_path / "c.png"))
    assert out.returncode == 0, out.stderr
    assert "one attention layer: 1,048,576 weights (W_q, W_k, W_v, W_o)" in out.stdout
    assert "4x the inner products when T doubles" in out.stdout
    assert (tmp_path / "c.png").stat().st_size > 1000
    report = json.loads(explain("cost", "--preset", "gpt2-124m", "--json").stdout)
    assert report["params"]["total"] == 124_439_808


def test_the_command_reads_a_run_s_configuration(small_run_dir):
    out = explain("cost", "--run", str(small_run_dir), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["context"] == 16


@pytest.mark.parametrize("args, message", [
    (["--run", "no/such/run"], "run folder no/such/run does not exist"),
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--n-head", "7", "--d-model", "512"], "n_head"),
])
def test_bad_input_is_one_line(args, message):
    out = explain("cost", *args)
    assert out.returncode != 0 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_the_activation_estimate_is_near_what_autograd_saves():
    # every tensor the backward pass keeps, by storage (the weights themselves left out), on the reference path
    config = small_config(block_size=64, d_model=64, n_kv_head=None)
    model = build_model(config)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, config.vocab_size, (4, config.block_size))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(idx, idx)
    estimate = cost_report(config, batch_size=4)["activation_bytes"]["total"]
    assert 0.8 < sum(saved.values()) / estimate < 1.25


def test_the_help_holds_the_model_s_settings_not_training_s_and_the_6n_line_says_what_n_is(capsys):
    from tinylm.cli import main

    with pytest.raises(SystemExit):
        main(["explain", "cost", "--help"])
    text = capsys.readouterr().out
    assert "--n-layer" in text and "--d-model" in text and "--batch" in text
    for training in ("--max-steps", "--lr", "--muon-lr", "--log-to", "--wandb-mode", "--sample-tokens", "--corpus"):
        assert training not in text, training  # what a training run does, not what a model costs
    config = resolve_config(preset="tiny").model  # an untied head: the embedding table multiplies nothing
    report = cost_report(config)
    line = next(x for x in format_cost(report).splitlines() if x.strip().startswith("(N = all"))
    gap = report["flops_per_token"]["rule_6n"] / report["flops_per_token"]["training"] - 1
    assert f"N = all {count_params(config):,} parameters, embedding tables too" in line and f"{gap:+.0%}" in line
    # with N the weights of the matrix multiplications, the rule is the exact count, which torch's counter checks
    assert report["rule_6n_matmul"] == report["flops_per_token"]["training"] and f"{report['rule_6n_matmul']:,}" in line
