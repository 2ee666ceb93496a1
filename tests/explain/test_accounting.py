"""Parameter, FLOP and memory accounting: formulas checked against the real modules and numbers worked out by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinylm.config import GPTConfig, resolve_config
from tinylm.errors import TinyLMError
from tinylm.explain.accounting import (
    attention_inner_products,
    attention_layer_params,
    count_params,
    flops_per_token,
    forward_flops_breakdown,
    matmul_params,
    param_breakdown,
    summary,
    training_memory,
)
from tinylm.model import GPT, CausalSelfAttention


def real_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied matrix is one parameter, counted once


def test_one_multi_head_attention_layer_of_the_original_transformer():
    # d = 512, n_h = 8, d_h = 64: 3 * 8 * (512 x 64) + (8 * 64) x 512 = 1,048,576 weights without biases
    config = GPTConfig(d_model=512, n_head=8, bias=False)
    assert config.head_dim == 64
    assert attention_layer_params(config) == 1_048_576
    assert real_count(CausalSelfAttention(config)) == 1_048_576


@st.composite
def configs(draw) -> GPTConfig:
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_head = n_kv * draw(st.sampled_from([1, 2]))
    return GPTConfig(
        vocab_size=draw(st.integers(1, 300)),
        block_size=draw(st.integers(1, 64)),
        n_layer=draw(st.integers(1, 3)),
        d_model=n_head * draw(st.sampled_from([2, 4, 6])),
        n_head=n_head,
        n_kv_head=n_kv,
        mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        d_ff=draw(st.none() | st.integers(1, 50)),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        norm_position=draw(st.sampled_from(["pre", "post"])),
        positions=draw(st.sampled_from(["learned", "sinusoidal", "rope", "none"])),
        bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(configs())
def test_the_formula_counts_every_parameter_of_the_real_model(config):
    assert count_params(config) == real_count(GPT(config))


def test_gpt2_small_by_parts():
    parts = param_breakdown(resolve_config(preset="gpt2-124m").model)
    assert parts["token_embedding"] == 50257 * 768 and parts["position_embedding"] == 1024 * 768
    assert parts["lm_head"] == 0  # tied
    assert sum(parts.values()) == 124_439_808


def test_flops_per_token_is_the_palm_formula():
    for config in (resolve_config(preset=p).model for p in ("tiny", "gpt2-124m", "llama")):
        L, nh, hs, T = config.n_layer, config.n_head, config.head_dim, config.block_size
        assert flops_per_token(config) == 6 * matmul_params(config) + 12 * L * nh * hs * T
        assert flops_per_token(config, seq_len=128) == 6 * matmul_params(config) + 12 * L * nh * hs * 128


def test_the_forward_flops_of_the_matmuls_are_twice_the_weights_they_use():
    config = GPTConfig(vocab_size=100, block_size=8, n_layer=2, d_model=32, n_head=4, n_kv_head=2, mlp="swiglu")
    model = GPT(config)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    parts = forward_flops_breakdown(config)
    assert parts["attention_projections"] + parts["mlp"] + parts["lm_head"] == 2 * weights


def test_doubling_the_context_quadruples_inner_products_but_not_parameters():
    short, long = GPTConfig(block_size=1000), GPTConfig(block_size=2000)
    assert attention_inner_products(long) == 4 * attention_inner_products(short)
    assert attention_inner_products(short) == 12 * 12 * 1000**2
    assert count_params(long) - count_params(short) == 1000 * 768  # only the learned position table grows
    rope_short, rope_long = GPTConfig(block_size=1000, positions="rope"), GPTConfig(block_size=2000, positions="rope")
    assert count_params(rope_long) == count_params(rope_short)


def test_adamw_training_memory_is_16_bytes_per_parameter():
    config = resolve_config(preset="tiny").model
    memory = training_memory(config)
    assert memory["total"] == 16 * count_params(config)
    assert training_memory(config, optimizer="sgd")["total"] == 8 * count_params(config)
    with pytest.raises(TinyLMError, match="unknown optimizer 'adam'"):
        training_memory(config, optimizer="adam")


def test_summary_line():
    line = summary(resolve_config(preset="gpt2-124m").model)
    assert "124,439,808 parameters" in line and "MFLOPs per token" in line
