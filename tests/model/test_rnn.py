"""The RNN and LSTM language models: the equations, causality, truncated BPTT, padding and the state as cache."""

from __future__ import annotations

import math

import pytest
import torch

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.generate.engine import Engine
from tinylm.generate.steps import decode_one_token, prefill
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import IGNORE_INDEX, RecurrentLM, RecurrentState, build_model
from tinylm.model.rnn import count_recurrent_params

FAMILIES = ("rnn", "lstm")


def make(family: str, *, vocab: int = 23, d: int = 16, layers: int = 2, block: int = 32, seed: int = 0,
         **kw) -> RecurrentLM:
    torch.manual_seed(seed)
    config = GPTConfig(family=family, vocab_size=vocab, block_size=block, n_layer=layers, d_model=d, n_head=1, **kw)
    return build_model(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", [1, 3])
def test_fused_layers_compute_the_written_out_equations(family, layers):
    model = make(family, layers=layers)
    idx = torch.randint(0, 23, (3, 11))
    fused, _ = model(idx)
    assert torch.allclose(fused, model.reference_forward(idx), atol=1e-5)


def test_one_rnn_step_by_hand():
    """A 1-unit RNN: h_1 = tanh(e W_ih + b), h_2 = tanh(e' W_ih + h_1 W_hh + b), logits = h E^T."""
    model = make("rnn", vocab=2, d=1, layers=1)
    with torch.no_grad():
        model.E.weight.copy_(torch.tensor([[0.5], [-1.0]]))
        model.rnn.weight_ih_l0.fill_(2.0)
        model.rnn.weight_hh_l0.fill_(0.5)
        model.rnn.bias_ih_l0.fill_(0.1)
        model.rnn.bias_hh_l0.fill_(0.0)
    logits, _ = model(torch.tensor([[0, 1]]))
    h1 = math.tanh(0.5 * 2 + 0.1)
    h2 = math.tanh(-1.0 * 2 + h1 * 0.5 + 0.1)
    expected = torch.tensor([[[h1 * 0.5, h1 * -1.0], [h2 * 0.5, h2 * -1.0]]])  # tied head: u = h E^T
    assert torch.allclose(logits, expected, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_past_does_not_see_the_future(family):
    model = make(family)
    idx = torch.randint(0, 23, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % 23
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("family", FAMILIES)
def test_overfits_one_batch(family):
    model = make(family, d=48, layers=1).train()
    torch.manual_seed(1)
    x = torch.randint(0, 23, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert first > 2.5  # about log 23 at the start
    assert loss.item() < 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_truncated_bptt_cuts_the_gradient_but_not_the_forward_pass(family):
    model = make(family, bptt=4, layers=1, tie_embeddings=False).train()  # E is the input side alone
    idx = torch.randint(1, 23, (1, 12))
    idx[0, 0] = 0  # token 0 appears only at the first position
    targets = torch.full_like(idx, IGNORE_INDEX)
    targets[0, -1] = 5  # the loss reads only the last position

    def grad_of_first_token(bptt):
        model.config.bptt = bptt
        model.zero_grad()
        logits, loss = model(idx, targets)
        loss.backward()
        return logits.detach(), model.E.weight.grad[0].abs().sum().item()

    truncated_logits, truncated = grad_of_first_token(4)
    full_logits, full = grad_of_first_token(None)
    assert torch.allclose(truncated_logits, full_logits, atol=1e-6)  # the state still flows forward
    assert truncated == 0.0  # 11 steps back: beyond the 4-step truncation
    assert full > 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_state_is_a_cache_prefill_then_steps_equal_one_pass(family):
    model = make(family)
    idx = torch.randint(0, 23, (2, 10))
    full, _ = model(idx)
    cache = model.new_cache(2, 10)
    assert isinstance(cache, RecurrentState)
    steps = [prefill(model, idx[:, :4], cache)]
    for t in range(4, 10):
        steps.append(decode_one_token(model, idx[:, t], cache))
    assert cache.length == 10
    assert torch.allclose(torch.stack(steps[1:], dim=1), full[:, 4:], atol=1e-5)
    assert torch.allclose(steps[0], full[:, 3], atol=1e-5)
    cache.reorder(torch.tensor([1, 1]))
    assert torch.equal(cache.tensors[0][:, 0], cache.tensors[0][:, 1])
    cache.reset()
    assert cache.length == 0 and all(not t.any() for t in cache.tensors)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_is_not_read(family):
    model = make(family)
    short = torch.randint(0, 23, (1, 4))
    padded = torch.cat([torch.full((1, 3), 7), short], dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 4])
    alone, _ = model(short)
    with_pad, _ = model(padded, attention_mask=mask)
    assert torch.allclose(with_pad[:, 3:], alone, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_batches_match_the_naive_generator(family):
    model = make(family, block=24)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    params = SamplingParams(max_new_tokens=30, temperature=0)  # past the window: it is cut and recomputed
    with pytest.warns(UserWarning, match="exceed the model's context"):
        fast = Engine(model, params).generate(prompts)
    with pytest.warns(UserWarning, match="exceed the model's context"):
        slow = reference_generate(model, prompts, params)
    assert [c.token_ids for c in fast] == [c.token_ids for c in slow]
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=5, seed=3, num_samples=2)
    one = Engine(model, sampled).generate(prompts)
    two = Engine(model, sampled).generate(prompts)
    assert [c.token_ids for c in one] == [c.token_ids for c in two]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_formula(family, tied):
    model = make(family, vocab=31, d=12, layers=2, tie_embeddings=tied)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert sum(unique.values()) == count_recurrent_params(model.config)


def test_lstm_forget_gate_starts_open():
    model = make("lstm", d=8, layers=2)
    for layer in range(2):
        bias = getattr(model.rnn, f"bias_ih_l{layer}") + getattr(model.rnn, f"bias_hh_l{layer}")
        assert torch.equal(bias[8:16], torch.ones(8))  # the forget gate's bias: sigmoid(1) = 0.73 kept


def test_families_that_have_no_weights_are_refused():
    with pytest.raises(TinyLMError, match="counted from data"):
        build_model(GPTConfig(family="ngram", vocab_size=10, block_size=8, n_layer=1, d_model=8, n_head=1))
    with pytest.raises(TinyLMError, match="'rnn' or 'lstm'"):
        RecurrentLM(GPTConfig(vocab_size=10, block_size=8, n_layer=1, d_model=8, n_head=1))


def test_a_baseline_config_ignores_the_transformer_only_rules():
    # 50 is not divisible by 3 heads: an error for a Transformer, irrelevant to an LSTM
    with pytest.raises(TinyLMError, match="divisible by n_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, d_model=50, n_head=3)
    GPTConfig(family="lstm", vocab_size=10, block_size=8, n_layer=1, d_model=50, n_head=3)
    with pytest.raises(TinyLMError, match="bptt must be a positive integer"):
        GPTConfig(family="lstm", vocab_size=10, block_size=8, n_layer=1, d_model=8, n_head=1, bptt=0)
