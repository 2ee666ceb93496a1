"""A Transformer run's cost: cost.json at the start, the achieved and peak FLOP/s at the end (train/cost.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from trainkit import tiny_config

from tinylm.explain.accounting import count_params, flops_per_token
from tinylm.generate.cache import KVCache
from tinylm.model import build_model
from tinylm.run import load_run
from tinylm.train import train
from tinylm.train.cost import COST_FILE, cost_table, matmul_peak, probe_shapes, read_cost_table, training_time


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, data_dir):
    """One tiny Transformer run (tied head), and the lines it printed."""
    lines: list[str] = []
    out = tmp_path_factory.mktemp("cost") / "run"
    result = train(tiny_config(corpus, data_dir), out, progress=False, log=lines.append)
    return out, result, lines


def test_cost_json_counts_the_built_models_parameters_tied_head_once(run):
    out, _, _ = run
    table = read_cost_table(out)
    loaded = load_run(out)
    model, mc = loaded.model, loaded.config.model
    assert mc.tie_embeddings
    counted = sum(p.numel() for p in model.parameters())  # a shared tensor is yielded once
    every_tensor = sum(p.numel() for p in model.state_dict().values())  # the tied matrix twice
    assert counted < every_tensor
    parts = table["parameters_by_component"]
    assert table["parameters"] == counted == sum(parts.values()) == count_params(mc)
    assert parts["lm_head"] == 0 and parts["token_embedding"] == mc.vocab_size * mc.d_model


def test_cost_json_flops_and_cache_by_hand(run):
    out, _, _ = run
    table = read_cost_table(out)
    mc = load_run(out).config.model
    L, d, T, V, d_ff = mc.n_layer, mc.d_model, mc.block_size, mc.vocab_size, mc.hidden_dim
    assert mc.mlp == "swiglu" and mc.kv_heads == mc.n_head  # three MLP matrices, full-size keys and values
    N = L * (4 * d * d + 3 * d * d_ff) + d * V  # the matmul weights a token meets, the head's included
    flops = table["flops_per_token"]
    assert flops["training"] == 6 * N + 12 * L * d * T == flops_per_token(mc)
    assert flops["forward"] * 3 == flops["training"]
    # a key and a value of d numbers per layer: 2 x 2 x 32 x 4 bytes in float32
    assert table["kv_cache_bytes_per_token"] == {"float32": 2 * L * d * 4, "bfloat16": 2 * L * d * 2} == {
        "float32": 512, "bfloat16": 256}
    cache = KVCache.for_model(load_run(out).model, 1, 1)  # what generation really allocates for one position
    assert sum(layer.k.nbytes + layer.v.nbytes for layer in cache) == table["kv_cache_bytes_per_token"]["float32"]


def test_cost_table_of_an_untied_gelu_model(corpus, data_dir):
    config = tiny_config(corpus, data_dir, tie_embeddings=False, mlp="gelu", vocab_size=40)
    model = build_model(config.model)
    table = cost_table(config, model)
    assert table["parameters"] == sum(p.numel() for p in model.parameters()) == count_params(config.model)
    assert table["parameters_by_component"]["lm_head"] == 40 * config.model.d_model


def test_the_end_line_and_run_json_give_plausible_rates(run):
    out, result, lines = run
    (line,) = [line for line in lines if line.startswith("cost: ")]
    assert re.fullmatch(r"cost: [\d.,]+ MFLOPs/token forward, [\d.,]+ training; achieved [\d.]+ [MGT]FLOP/s, "
                        r"\d+% of a measured [\d.]+ [MGT]FLOP/s float32 matmul peak", line), line
    cost = json.loads((out / "run.json").read_text())["cost"]
    assert cost["tokens"] == result.tokens
    assert 0 < cost["training_seconds"] < result.elapsed  # evaluation and saving left out
    assert cost["achieved_flops_per_s"] == pytest.approx(
        cost["flops_per_token_training"] * cost["tokens"] / cost["training_seconds"])
    assert cost["peak_flops_per_s"] > 0
    assert 0 < cost["mfu"] < 1.5
    assert cost["flops_per_token_training"] == read_cost_table(out)["flops_per_token"]["training"]


def test_training_time_reads_each_rows_new_tokens_over_its_rate():
    rows = [{"kind": "train", "step": 1, "tokens": 100, "tokens_per_s": 50.0},
            {"kind": "eval", "step": 1, "loss": 3.0},
            {"kind": "train", "step": 3, "tokens": 300, "tokens_per_s": 400.0},
            {"kind": "final", "step": 3}]
    assert training_time(rows) == (300, 2.0 + 0.5)


def test_the_probe_draws_no_random_numbers(corpus, data_dir):
    config = tiny_config(corpus, data_dir)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    peak = matmul_peak(probe_shapes(config, torch.device("cpu")), torch.device("cpu"), torch.float32, seconds=0.05)
    assert peak > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_a_recurrent_run_has_no_cost_table(tmp_path, corpus, data_dir):
    lines: list[str] = []
    config = tiny_config(corpus, data_dir, family="rnn", max_steps=2, eval_interval=2)
    train(config, tmp_path / "rnn", progress=False, log=lines.append)
    assert not (tmp_path / "rnn" / COST_FILE).exists()
    assert not any(line.startswith("cost: ") for line in lines)
    assert json.loads((tmp_path / "rnn" / "run.json").read_text())["cost"] is None


def test_a_resumed_run_counts_the_training_of_every_session(tmp_path, corpus, data_dir):
    config = tiny_config(corpus, data_dir)
    out = tmp_path / "resumed"
    train(config, out, stop_after=4, progress=False, log=lambda line: None)
    result = train(None, out, resume=True, progress=False, log=lambda line: None)
    cost = json.loads((out / "run.json").read_text())["cost"]
    assert cost["tokens"] == result.tokens == 8 * 4 * 32  # 8 steps of 4 x 32 tokens, 4 of them before the stop
