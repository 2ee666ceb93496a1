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
