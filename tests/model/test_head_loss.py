"""The head and the loss a slice at a time: the same loss and gradients as lm_head + F.cross_entropy; the
per-position loss from logits, a slice of positions at a time, the same numbers as from all of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinylm.config import GPTConfig
from tinylm.model.gpt import GPT
from tinylm.model import head_loss as head_loss_module
from tinylm.model.head_loss import IGNORE_INDEX, head_loss, next_token_loss


def plain(h, W, y, softcap):
    u = h @ W.T
    if softcap is not None:
        u = softcap * torch.tanh(u / softcap)
    return F.cross_entropy(u, y, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_equals_cross_entropy_of_the_full_logits_in_float64(softcap, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(29, 6, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (29,), generator=g)
    y[[0, 5, 28]] = IGNORE_INDEX  # padding: no loss, no gradient
    expected = plain(h, W, y, softcap)
    gh, gW = torch.autograd.grad(expected * 0.37, (h, W))
    got = head_loss(h, W, y, torch.float64, softcap, chunk=chunk)
    dh, dW = torch.autograd.grad(got * 0.37, (h, W))  # an outer factor (the loop's 1 / n_targets) scales both
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dW, gW, rtol=1e-10, atol=1e-12)
    assert dh[[0, 5, 28]].abs().max() == 0  # an ignored position gets no gradient



def test_the_plain_next_token_loss_from_logits_is_the_same_loss():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)  # (B, T, d)
    W = torch.randn(11, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 11, (3, 5), generator=g)
    y[0, :2] = IGNORE_INDEX
    total = head_loss(h.flatten(0, 1), W, y.flatten(), torch.float64)
    each = next_token_loss(h @ W.T, y, reduction="none")  # (B*T,)
    assert each.shape == (15,) and (each[:2] == 0).all()
    torch.testing.assert_close(next_token_loss(h @ W.T, y, reduction="sum"), total, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(next_token_loss(h @ W.T, y), total / 13, rtol=1e-12, atol=1e-12)  # 13 targets count


@pytest.mark.parametrize("slice_elements", [1, 11 * 4, 11 * 6, 1 << 23])
def test_per_position_losses_in_slices_are_those_of_the_whole_logits_bit_for_bit(monkeypatch, slice_elements):
    monkeypatch.setattr(head_loss_module, "SLICE_ELEMENTS", slice_elements)  # 1, 4 or 6 positions a slice, or all
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, 11, generator=g, requires_grad=True)  # (B, T, |V|), float32 as evaluation's
    y = torch.randint(0, 11, (3, 7), generator=g)
    y[1, 3:] = IGNORE_INDEX
    each = next_token_loss(logits, y, reduction="none")
    whole = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    assert torch.equal(each, whole)
    assert torch.equal(torch.autograd.grad(each.sum(), logits)[0], torch.autograd.grad(whole.sum(), logits)[0])


def test_a_hand_worked_case():
    # one position, logits (2, 1, -1) from h = (1, 0) and W's rows (2, 0), (1, 0), (-1, 0); target 0
    h = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    W = torch.tensor([[2.0, 0.0], [1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss = head_loss(h, W, torch.tensor([0]), torch.float64)
    p = torch.tensor([2.0, 1.0, -1.0], dtype=torch.float64).softmax(0)  # 0.7054, 0.2595, 0.0351
    assert loss.item() == pytest.approx(-torch.log(p[0]).item(), abs=1e-12)  # 0.3490
    loss.backward()
    # d loss / d u = p - onehot(0); d u / d h = W, so dh = (p - e_0) @ W
    expected_dh = (p - torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)) @ W.detach()
    torch.testing.assert_close(h.grad[0], expected_dh)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_loss_only_path_matches_the_logits_path(tie):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, d_model=32, n_head=4, tie_embeddings=tie))
    x = torch.randint(0, 50, (3, 16))
    y = torch.randint(0, 50, (3, 16))
    y[1, :4] = IGNORE_INDEX
    for reduction in ("mean", "sum"):
        logits, expected = model(x, y, reduction=reduction)
        grads = torch.autograd.grad(expected, list(model.parameters()))
        none, got = model(x, y, reduction=reduction, return_logits=False)
        assert none is None and logits.shape == (3, 16, 50)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for a, b in zip(torch.autograd.grad(got, list(model.parameters())), grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_autocast_loss_is_close_to_float32():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, d_model=32, n_head=4))
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    _, exact = model(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, fast = model(x, y, return_logits=False)
    assert fast.dtype == torch.float32 and abs(fast.item() - exact.item()) < 0.02


def test_without_gradients_only_the_loss_is_computed():
    g = torch.Generator().manual_seed(1)
    h, W, y = torch.randn(9, 4, generator=g), torch.randn(7, 4, generator=g), torch.randint(0, 7, (9,), generator=g)
    with torch.no_grad():
        assert head_loss(h, W, y).item() == pytest.approx(plain(h, W, y, None).item(), rel=1e-6)
    h.requires_grad_()  # the head frozen: h alone gets a gradient
    head_loss(h, W, y).backward()
    assert W.grad is None and h.grad.abs().sum() > 0
