"""Weight-decay groups: which parameters decay, and the optimizers built from them."""

import torch

from tinylm.config import GPTConfig, TrainConfig
from tinylm.model import GPT
from tinylm.train.optim import make_optimizer, parameter_groups


def gpt(**kw) -> GPT:
    return GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, d_model=16, n_head=2, **kw))


def test_matrices_and_embeddings_decay_norms_and_biases_do_not():
    model = gpt(bias=True, norm="layernorm", positions="learned", tie_embeddings=False)
    decay, no_decay = parameter_groups(model)
    assert "E.weight" in decay and "pos_emb.P.weight" in decay and "lm_head.weight" in decay
    assert "blocks.0.attn.W_o.weight" in decay and "blocks.1.mlp.W_2.weight" in decay
    assert "blocks.0.attn.W_o.bias" in no_decay and "blocks.0.norm_1.weight" in no_decay
    assert "blocks.0.norm_1.bias" in no_decay and "norm_f.weight" in no_decay
    params = dict(model.named_parameters())
    assert all(params[n].dim() >= 2 for n in decay) and all(params[n].dim() == 1 for n in no_decay)
    assert set(decay) | set(no_decay) == set(params) and not set(decay) & set(no_decay)


def test_a_tied_head_is_the_embedding_listed_once():
    model = gpt(tie_embeddings=True)
    decay, no_decay = parameter_groups(model)
    assert "E.weight" in decay and "lm_head.weight" not in decay + no_decay
    n = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, TrainConfig())
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == n


def test_adamw_and_sgd_groups_carry_the_settings():
    model = gpt(norm="rmsnorm", bias=False)
    adamw = make_optimizer(model, TrainConfig(weight_decay=0.05, beta1=0.8, beta2=0.99))
    assert isinstance(adamw, torch.optim.AdamW)
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.05, 0.0]
    assert adamw.param_groups[0]["betas"] == (0.8, 0.99)
    sgd = make_optimizer(model, TrainConfig(optimizer="sgd", momentum=0.5, weight_decay=0.01))
    assert isinstance(sgd, torch.optim.SGD)
    assert [g["weight_decay"] for g in sgd.param_groups] == [0.01, 0.0]
    assert sgd.param_groups[0]["momentum"] == 0.5


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest_each_at_its_rate():
    from tinylm.train.optim import OptimizerChain, parameter_roles

    model = gpt(norm="rmsnorm", bias=False, tie_embeddings=False, value_embed=True, bigram_hash=11)
    config = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, embed_lr=0.05, head_lr=0.004, weight_decay=0.1,
                         muon_weight_decay=0.0)
    optimizer = make_optimizer(model, config)
    assert isinstance(optimizer, OptimizerChain)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    roles = parameter_roles(model)
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert in_muon == {n for n, r in roles.items() if r == "matrix"}
    assert all(n.startswith("blocks.") for n in in_muon) and "blocks.0.attn.W_q.weight" in in_muon
    assert {"E.weight", "V_emb.weight", "bigram.weight"} <= {n for n, r in roles.items() if r == "embedding"}
    assert roles["lm_head.weight"] == "head" and roles["blocks.0.attn.ve_weight"] == "vector"
    rates = {g["roles"]: (g["peak_lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert rates == {"matrix": (0.02, 0.0), "embedding": (0.05, 0.1), "head": (0.004, 0.1), "vector": (1e-3, 0.0)}


def test_muon_steps_exactly_as_torch_optim_muon_called_directly():
    from tinylm.train.optim import set_schedule

    model = gpt(norm="rmsnorm", bias=False)
    config = TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.03, muon_momentum=0.9, weight_decay=0.05)
    optimizer = make_optimizer(model, config)
    matrices = {n: p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    twins = {n: torch.nn.Parameter(p.detach().clone()) for n, p in matrices.items()}
    direct = torch.optim.Muon(list(twins.values()), lr=0.03 * 0.5, weight_decay=0.05, momentum=0.9, nesterov=True,
                              adjust_lr_fn="original")
    for step in range(3):
        idx = torch.randint(0, 40, (2, 16), generator=torch.Generator().manual_seed(step))
        _, loss = model(idx, torch.roll(idx, -1, 1))
        loss.backward()
        for n, twin in twins.items():
            twin.grad = matrices[n].grad.clone()
        set_schedule(optimizer, lambda peak: peak * 0.5)  # half the peak, as a schedule would
        optimizer.step()
        optimizer.zero_grad()
        direct.step()
        for n, twin in twins.items():
            assert torch.equal(matrices[n].detach(), twin.detach()), (step, n)


def test_a_muon_update_is_close_to_orthogonal():
    # the first step from zero momentum: the update is lr * NS(g (1 + mu)), every singular value near 1
    w = torch.nn.Parameter(torch.zeros(48, 32))
    w.grad = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    torch.optim.Muon([w], lr=1.0, weight_decay=0.0, adjust_lr_fn="original").step()
    # Keller Jordan's scaling: sqrt(max(1, rows / cols)) = sqrt(1.5)
    s = torch.linalg.svdvals(-w.detach() / 1.5 ** 0.5)
    assert s.min() > 0.6 and s.max() < 1.25  # his coefficients land in about [0.7, 1.2], not exactly 1
