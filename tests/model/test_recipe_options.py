"""The modern-recipe options of the Transformer, each against a hand-worked answer or a property.

ReLU^2, QK-norm, zero-initialised projections, logit soft-capping, value embeddings, the
bigram-hash embedding and an untied head with its own init (`tinylm.config.GPTConfig`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tinylm.config import GPTConfig
from tinylm.errors import TinyLMError
from tinylm.model import GPT

OPTIONS = [
    {"mlp": "relu2"},
    {"qk_norm": True},
    {"zero_init_projections": True},
    {"logit_softcap": 5.0},
    {"value_embed": True},
    {"bigram_hash": 37},
    {"tie_embeddings": False, "head_init_std": 0.0},
    {"mlp": "relu2", "qk_norm": True, "logit_softcap": 5.0, "value_embed": True, "bigram_hash": 37},
]


def config(**changes) -> GPTConfig:
    base = GPTConfig(vocab_size=61, block_size=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, mlp="swiglu",
                     norm="rmsnorm", positions="rope", bias=False)
    return dataclasses.replace(base, **changes)


def build(cfg: GPTConfig, seed: int = 0, perturb: bool = True) -> GPT:
    """A model; ``perturb`` moves every weight off its init (zero-init tables would hide bugs)."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return model


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("changes", OPTIONS)
def test_every_option_keeps_the_model_causal(changes):
    model = build(config(**changes))
    idx = tokens(2, 10)
    with torch.no_grad():
        logits, _ = model(idx)
        for t in (1, 4, 9):
            changed = idx.clone()
            changed[:, t:] = (idx[:, t:] + 1) % 61
            new_logits, _ = model(changed)
            torch.testing.assert_close(new_logits[:, :t], logits[:, :t], atol=1e-6, rtol=0)


@pytest.mark.parametrize("changes", OPTIONS)
def test_every_option_ignores_padding(changes):
    model = build(config(**changes))
    real = tokens(1, 5)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        alone, _ = model(real)
        left, _ = model(torch.cat([pad, real], 1), attention_mask=torch.tensor([[0] * 3 + [1] * 5]))
    torch.testing.assert_close(left[:, 3:], alone, atol=1e-5, rtol=0)


def test_relu2_mlp_is_relu_squared_then_w2():
    model = build(config(mlp="relu2"))
    mlp = model.blocks[0].mlp
    assert mlp.W_1.weight.shape == (4 * 32, 32)  # hidden width 4 d, no gate matrix
    assert not hasattr(mlp, "W_3")
    x = torch.randn(3, 32)
    expected = (torch.clamp(x @ mlp.W_1.weight.T, min=0) ** 2) @ mlp.W_2.weight.T
    torch.testing.assert_close(mlp(x), expected)


def test_qk_norm_makes_attention_blind_to_the_scale_of_w_q_and_w_k():
    model = build(config(qk_norm=True))
    idx = tokens(2, 12)
    with torch.no_grad():
        before, _ = model(idx)
        for block in model.blocks:
            block.attn.W_q.weight.mul_(50.0)
            block.attn.W_k.weight.mul_(3.0)
        after, _ = model(idx)
    torch.testing.assert_close(after, before, atol=1e-3, rtol=1e-3)  # up to the norm's eps
    plain = build(config())
    with torch.no_grad():
        a, _ = plain(idx)
        plain.blocks[0].attn.W_q.weight.mul_(50.0)
        b, _ = plain(idx)
    assert not torch.allclose(a, b, atol=1e-2)  # without the norm the same change matters


def test_zero_init_projections_make_every_block_the_identity_at_step_0():
    torch.manual_seed(0)
    model = GPT(config(zero_init_projections=True)).eval()
    for block in model.blocks:
        assert not block.attn.W_o.weight.any() and not block.mlp.W_2.weight.any()
    idx = tokens(2, 8)
    with torch.no_grad():
        logits, _ = model(idx)
        h = model.norm_f(model.E(idx))  # the stream is the embedding alone
    torch.testing.assert_close(logits, h @ model.E.weight.T)
    # and the projections still learn: their gradients are not zero
    _, loss = model.train()(idx, torch.roll(idx, -1, 1))
    loss.backward()
    assert model.blocks[0].attn.W_o.weight.grad.abs().sum() > 0


def test_logit_softcap_is_c_tanh_u_over_c_and_stays_inside_the_cap():
    capped = build(config(logit_softcap=2.0))
    plain = build(config())
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        for p in capped.parameters():
            p.mul_(4.0)  # large weights, so the raw logits go far past the cap
        plain.load_state_dict(capped.state_dict())
        idx = tokens(2, 8)
        u, _ = plain(idx)
        c, _ = capped(idx)
    assert u.abs().max() > 2.0
    torch.testing.assert_close(c, 2.0 * torch.tanh(u / 2.0))
    assert c.abs().max() < 2.0


def test_bigram_hash_rows_worked_by_hand():
    model = build(config(bigram_hash=11))
    idx = torch.tensor([[3, 5, 7], [0, 0, 60]])
    # row 1 + (prev * 1000003 + cur) mod 10; the first position has no previous token: row 0
    #   (3, 5): 3000014 mod 10 = 4 -> 5      (5, 7): 5000022 mod 10 = 2 -> 3
    #   (0, 0): 0 -> 1                        (0, 60): 60 mod 10 = 0 -> 1
    assert model.bigram_ids(idx).tolist() == [[0, 5, 3], [0, 1, 1]]
    # a padded previous position is no previous token
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]]).bool()
    assert model.bigram_ids(idx, mask).tolist() == [[0, 5, 3], [0, 0, 1]]


def test_bigram_table_starts_at_zero_and_its_row_is_added_to_the_embedding():
    torch.manual_seed(0)
    model = GPT(config(bigram_hash=37)).eval()
    assert not model.bigram.weight.any()
    plain = GPT(config()).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("bigram")})
    idx = tokens(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], plain(idx)[0])  # at zero it changes nothing
        model.bigram.weight.normal_()
        assert not torch.allclose(model(idx)[0], plain(idx)[0])


def test_value_embeddings_add_the_tokens_row_to_every_layers_values():
    model = build(config(value_embed=True))
    assert model.V_emb.weight.shape == (61, 2 * 8)  # n_kv_head x head size
    plain = build(config())
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "V_emb" not in k and "ve_weight" not in k})
    idx = tokens(2, 8)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.ve_weight.zero_()  # with no weight on it the table changes nothing
        torch.testing.assert_close(model(idx)[0], plain(idx)[0])
        model.blocks[1].attn.ve_weight.fill_(1.0)
        assert not torch.allclose(model(idx)[0], plain(idx)[0])


def test_an_untied_head_takes_its_own_init():
    torch.manual_seed(0)
    zero = GPT(config(tie_embeddings=False, head_init_std=0.0))
    assert not zero.lm_head.weight.any() and zero.E.weight.any()
    wide = GPT(config(tie_embeddings=False, head_init_std=0.5))
    assert 0.45 < wide.lm_head.weight.std().item() < 0.55
    with pytest.raises(TinyLMError, match="head_init_std initialises an untied output head"):
        config(head_init_std=0.1)


@pytest.mark.parametrize("bad, match", [({"logit_softcap": 0.0}, "logit_softcap must be a positive number"),
                                        ({"bigram_hash": 1}, "bigram_hash is a number of buckets"),
                                        ({"bigram_hash": -4}, "bigram_hash is a number of buckets"),
                                        ({"mlp": "relu3"}, "mlp must be one of")])
def test_bad_option_values_say_what_is_expected(bad, match):
    with pytest.raises(TinyLMError, match=match):
        config(**bad)


def test_the_loss_with_a_softcap_is_the_cross_entropy_of_the_capped_logits():
    model = build(config(logit_softcap=3.0))
    idx, targets = tokens(2, 8), tokens(2, 8, seed=1)
    with torch.no_grad():
        logits, loss = model(idx, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("changes", OPTIONS)
def test_the_accounting_counts_every_options_parameters(changes):
    from tinylm.explain.accounting import count_params

    cfg = config(**changes)
    model = GPT(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
