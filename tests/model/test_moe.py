"""The Mixture-of-Experts MLP: routing, the balancing losses and bias, reference == fast, generation, the counts."""

from __future__ import annotations

import math

import pytest
import torch

from tinylm.config import GPTConfig, resolve_config
from tinylm.errors import TinyLMError
from tinylm.explain.accounting import forward_flops_breakdown
from tinylm.explain.cost import cost_report, format_cost
from tinylm.generate.engine import Engine
from tinylm.generate.reference import reference_generate
from tinylm.generate.sampling import SamplingParams
from tinylm.model import GPT
from tinylm.model.memory import count_active_params, count_params
from tinylm.model.moe import (MoE, bias_update, grouped_linear, load_balance_loss, load_cv, route,
                              router_z_loss)


def moe_config(**changes) -> GPTConfig:
    settings = dict(vocab_size=61, block_size=24, n_layer=2, d_model=32, n_head=4, moe_experts=4, moe_top_k=2)
    return GPTConfig(**{**settings, **changes})


# ----- routing on hand-worked logits ---------------------------------------------------------------


def test_softmax_routing_takes_the_top_k_and_renormalises_over_them():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))  # softmax: these numbers
    r = route(logits, top_k=2, router="softmax")
    assert r.experts.tolist() == [[3, 2], [0, 1]]
    torch.testing.assert_close(r.gates, torch.tensor([[0.4 / 0.7, 0.3 / 0.7], [0.4 / 0.7, 0.3 / 0.7]]))
    torch.testing.assert_close(r.scores[0], torch.tensor([0.1, 0.2, 0.3, 0.4]))
    kept = route(logits, top_k=2, router="softmax", normalize=False)  # Qwen2-MoE's norm_topk_prob = False
    torch.testing.assert_close(kept.gates, torch.tensor([[0.4, 0.3], [0.4, 0.3]]))


def test_sigmoid_routing_scores_each_expert_alone_and_normalises_the_chosen():
    logits = torch.tensor([[0.0, math.log(3), -math.log(3), math.log(9)]])  # sigmoid: 0.5, 0.75, 0.25, 0.9
    r = route(logits, top_k=2, router="sigmoid")
    assert r.experts.tolist() == [[3, 1]]
    torch.testing.assert_close(r.gates, torch.tensor([[0.9 / 1.65, 0.75 / 1.65]]))
    torch.testing.assert_close(route(logits, 2, "sigmoid", normalize=False).gates, torch.tensor([[0.9, 0.75]]))


def test_the_bias_changes_which_experts_are_chosen_but_not_their_gate_weights():
    logits = torch.tensor([[0.0, math.log(3), -math.log(3), math.log(9)]])  # sigmoid: 0.5, 0.75, 0.25, 0.9
    r = route(logits, top_k=2, router="sigmoid", bias=torch.tensor([0.0, 0.0, 0.7, 0.0]))
    assert r.experts.tolist() == [[2, 3]]  # 0.25 + 0.7 = 0.95 now beats 0.75
    torch.testing.assert_close(r.gates, torch.tensor([[0.25 / 1.15, 0.9 / 1.15]]))  # the scores, without the bias


# ----- the balancing losses and the bias update -----------------------------------------------------


def test_load_balancing_loss_on_a_hand_worked_example():
    # two tokens, two experts, top 1: both pick expert 0; f = (1, 0), P = (0.7, 0.3): E sum f P = 2 * 0.7
    r = route(torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]])), top_k=1, normalize=False)
    assert r.experts.flatten().tolist() == [0, 0]
    assert load_balance_loss(r, 2).item() == pytest.approx(1.4)
    # even loads and even probabilities: exactly 1, whatever E and k
    even = route(torch.zeros(8, 4), top_k=2)
    even = even._replace(experts=torch.tensor([[0, 1], [2, 3]] * 4))
    assert load_balance_loss(even, 4).item() == pytest.approx(1.0)


def test_the_aux_loss_gradient_moves_probability_away_from_the_overloaded_expert():
    logits = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]])).requires_grad_()
    load_balance_loss(route(logits, top_k=1, normalize=False), 2).backward()
    assert (logits.grad[:, 0] > 0).all() and (logits.grad[:, 1] < 0).all()  # descent lowers expert 0's logits


def test_router_z_loss_on_a_hand_worked_example():
    # logsumexp of (0, 0) is ln 2, of (ln 3, 0) is ln 4 = 2 ln 2: mean of squares (1 + 4) / 2 (ln 2)^2
    logits = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]])
    assert router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2) ** 2)


def test_bias_update_moves_each_expert_toward_the_mean_load():
    bias = torch.tensor([0.0, 0.1, 0.0, -0.2])
    bias_update(bias, torch.tensor([6, 2, 4, 4]), rate=0.001)  # mean 4: the first over, the second under
    torch.testing.assert_close(bias, torch.tensor([-0.001, 0.101, 0.0, -0.2]))


def test_a_bias_layer_chooses_by_the_bias_and_weighs_by_the_scores_alone():
    moe = MoE(moe_config(moe_router="sigmoid", moe_balance="bias"))
    x = torch.randn(10, 32)
    _, before = moe.route(x)
    moe.bias[:] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 now wins every token's choice
    logits, after = moe.route(x)
    assert (after.experts == 3).any(dim=1).all() and not (before.experts == 3).all()
    s = torch.sigmoid(logits)
    torch.testing.assert_close(after.gates, s.gather(1, after.experts) / s.gather(1, after.experts).sum(1, True))


def test_load_cv_is_zero_when_even_and_grows_to_sqrt_e_minus_one():
    assert load_cv(torch.tensor([5, 5, 5, 5])) == 0.0
    assert load_cv(torch.tensor([8, 0, 0, 0])) == pytest.approx(math.sqrt(3))
    assert load_cv(torch.tensor([4, 4, 0, 0])) == pytest.approx(1.0)


# ----- reference == fast -------------------------------------------------------------------------------


def forward_and_grads(model: GPT, idx: torch.Tensor, dispatch: str, grouped: str = "auto"):
    for block in model.blocks:
        block.mlp.dispatch, block.mlp.grouped = dispatch, grouped
    model.zero_grad()
    _, loss = model(idx, idx)
    aux = sum(b.mlp.aux_loss + b.mlp.z_loss for b in model.blocks if b.mlp.aux_loss is not None)
    (loss + 0.1 * aux).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("changes", [
    dict(mlp="swiglu", bias=False), dict(mlp="gelu", bias=True), dict(mlp="relu2", moe_shared_experts=1),
    dict(mlp="geglu", moe_router="sigmoid", moe_balance="bias"), dict(mlp="swiglu", d_model=30, n_head=3),
    dict(moe_experts=8, moe_top_k=3, moe_norm_topk=False)])
@pytest.mark.parametrize("grouped", ["grouped_mm", "split"])
def test_fast_dispatch_equals_the_reference_loop_forward_and_backward(changes, grouped):
    torch.manual_seed(0)
    model = GPT(moe_config(**changes))
    idx = torch.randint(0, 61, (3, 24))
    loss_ref, grads_ref = forward_and_grads(model, idx, "reference")
    loss_fast, grads_fast = forward_and_grads(model, idx, "fast", grouped)
    torch.testing.assert_close(loss_fast, loss_ref, atol=1e-5, rtol=0)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads_fast[name], g, atol=1e-5, rtol=1e-5, msg=name)
    assert all(g.abs().sum() > 0 for n, g in grads_ref.items() if ".experts." in n and ".weight" in n)


def test_grouped_linear_by_grouped_mm_and_by_split_agree_and_take_empty_groups():
    x, weight = torch.randn(10, 8), torch.randn(3, 12, 8)
    counts = torch.tensor([4, 0, 6])  # expert 1 gets no rows
    rows_expert = torch.repeat_interleave(torch.arange(3), counts)
    bias = torch.randn(3, 12)
    want = torch.cat([x[:4] @ weight[0].T + bias[0], x[4:] @ weight[2].T + bias[2]])
    for method in ("grouped_mm", "split"):
        torch.testing.assert_close(grouped_linear(x, weight, bias, counts, rows_expert, method), want)


def test_an_expert_no_token_chose_gets_a_zero_gradient_in_both_dispatches():
    torch.manual_seed(0)
    model = GPT(moe_config(moe_balance="bias"))
    for block in model.blocks:
        block.mlp.bias[:] = torch.tensor([1.0, 1.0, 0.0, -1.0])  # experts 0 and 1 take every token
    idx = torch.randint(0, 61, (2, 24))
    for dispatch in ("reference", "fast"):
        _, grads = forward_and_grads(model, idx, dispatch)
        assert grads["blocks.0.mlp.experts.3.W_1.weight"].abs().sum() == 0
        assert grads["blocks.0.mlp.experts.0.W_1.weight"].abs().sum() > 0


def test_a_training_forward_pass_counts_the_token_slots_and_an_eval_pass_does_not():
    model = GPT(moe_config())
    idx = torch.randint(0, 61, (2, 24))
    model(idx)
    layer = model.blocks[0].mlp
    assert int(layer.step_counts.sum()) == 2 * 24 * 2 and layer.aux_loss is not None
    model(idx)
    assert int(layer.step_counts.sum()) == 2 * 2 * 24 * 2  # adds up until the loop takes it
    model.eval()
    layer.step_counts = None
    model(idx)
    assert layer.step_counts is None


# ----- generation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [dict(mlp="swiglu"), dict(mlp="gelu", moe_shared_experts=1, moe_router="sigmoid")])
def test_cached_generation_equals_recomputing_every_step(changes):
    torch.manual_seed(0)
    model = GPT(moe_config(positions="rope", **changes)).eval()
    params = SamplingParams(max_new_tokens=16, temperature=0)
    prompt = [[3, 14, 15, 9, 26]]
    cached, naive = Engine(model, params).generate(prompt), reference_generate(model, prompt, params)
    assert cached[0].token_ids == naive[0].token_ids and len(cached[0].token_ids) == 16
    torch.testing.assert_close(torch.tensor(cached[0].logprobs), torch.tensor(naive[0].logprobs), atol=1e-5, rtol=0)


# ----- settings and counts -----------------------------------------------------------------------------


def test_the_flags_set_the_settings_and_the_default_expert_width_keeps_the_dense_flops():
    model = resolve_config(overrides=["--moe-experts", "8", "--moe-top-k", "2", "--moe-router", "sigmoid"]).model
    assert (model.moe_experts, model.moe_top_k, model.moe_router) == (8, 2, "sigmoid")
    assert model.hidden_dim == 512 and model.moe_hidden_dim == 256  # tiny's SwiGLU: 512 / 2
    assert GPTConfig(moe_experts=8, moe_top_k=3, mlp="swiglu", d_model=192, n_head=6).moe_hidden_dim == 168  # 170.7
    assert GPTConfig(moe_experts=8, moe_top_k=1, moe_shared_experts=1, moe_norm_topk=False).moe_hidden_dim == 1536
    assert GPTConfig(moe_experts=4, moe_d_ff=100).moe_hidden_dim == 100


@pytest.mark.parametrize("changes, words", [
    (dict(moe_top_k=5), "moe_top_k (5) must be between 1 and moe_experts (4)"),
    (dict(moe_experts=1), "2 or more experts"),
    (dict(moe_shared_experts=2), "moe_shared_experts is 0 or 1"),
    (dict(moe_top_k=1), "every gate weight 1"),
    (dict(moe_aux_weight=-0.1), "moe_aux_weight must be 0 or a positive number"),
    (dict(moe_router="tanh"), "moe_router must be one of"),
])
def test_impossible_combinations_are_one_line_errors(changes, words):
    with pytest.raises(TinyLMError, match=None) as refused:
        moe_config(**changes)
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_total_and_active_parameters_and_flops_by_hand():
    # d 16, GELU experts of width 8 without biases: 2 * 16 * 8 = 256 each; router 16 x 4
    config = GPTConfig(vocab_size=10, block_size=8, n_layer=1, d_model=16, n_head=2, bias=False, mlp="gelu",
                       moe_experts=4, moe_top_k=2, moe_d_ff=8, positions="rope", norm="rmsnorm")
    attention, norms, embeddings = 4 * 16 * 16, 3 * 16, 10 * 16  # W_q, W_k, W_v, W_o; 2 + final; tied E
    assert count_params(config) == embeddings + attention + norms + 4 * 256 + 64
    assert count_params(config) == sum(p.numel() for p in GPT(config).parameters())
    assert count_active_params(config) == embeddings + attention + norms + 2 * 256 + 64
    assert forward_flops_breakdown(config)["mlp"] == 2 * (2 * 256 + 64)
    shared = GPTConfig(**{**config.__dict__, "moe_shared_experts": 1})
    assert count_params(shared) - count_params(config) == 256 == count_active_params(shared) - count_active_params(config)
    assert count_params(shared) == sum(p.numel() for p in GPT(shared).parameters())
    report = cost_report(config)
    assert report["active_params"] == count_active_params(config) and report["moe"]["expert_params"] == 256
    assert "active per token" in format_cost(report)
