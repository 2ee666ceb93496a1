"""LoRA on the embedding and the output head (``lora_targets`` E, lm_head, or ``outer``), and LoRA's own recipe.

What is checked: row x of a corrected embedding is W[x] + (alpha / r) B[x] A, worked out by hand; the merged
weights compute what the adapted model computes, through the loss that reads the head's weight in slices
too; a tied head refuses them in one line; `tinylm finetune --lora-rank` on a model with two tables corrects
both, at LoRA's own rate, and then trains no separate rows for the chat tokens; ``lora_b_lr_ratio`` gives
B its multiple of A's rate; the counted adapter is what the model holds.
"""

from __future__ import annotations

import json

import pytest
import torch
from trainkit import tiny_config

from tinylm.checkpoint import load_checkpoint
from tinylm.errors import TinyLMError
from tinylm.finetune import LORA_LR, finetune
from tinylm.model import GPT
from tinylm.model.lora import (LoRAEmbedding, LoraSettings, adapter_size, adapter_state, add_lora, count_adapter,
                               merge_adapter)
from tinylm.run import checkpoint_path, load_run
from tinylm.train import train
from tinylm.train.optim import make_optimizer

QUIET = {"log": lambda line: None, "progress": False}


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory, corpus, data_dir):
    out = tmp_path_factory.mktemp("untied") / "run"
    train(tiny_config(corpus, data_dir, max_steps=4, tie_embeddings=False, optimizer="muon"), out, **QUIET)
    return out


def test_a_corrected_embedding_row_is_the_table_row_plus_the_scaled_low_rank_one():
    torch.manual_seed(0)
    base = torch.nn.Embedding(6, 4)
    layer = LoRAEmbedding(base, LoraSettings(rank=2, alpha=1.0))
    with torch.no_grad():
        layer.lora_B.copy_(torch.randn(6, 2))
    ids = torch.tensor([[5, 0, 5, 2]])
    W, A, B = base.weight.detach(), layer.lora_A.detach(), layer.lora_B.detach()
    by_hand = torch.stack([W[x] + 0.5 * (B[x] @ A) for x in (5, 0, 5, 2)])[None]  # alpha / r = 1 / 2
    assert torch.allclose(layer(ids), by_hand, atol=1e-6)
    merged = merge_adapter({"E.weight": W}, {"E.lora_A": A, "E.lora_B": B}, 0.5)["E.weight"]
    assert torch.allclose(merged[ids], by_hand, atol=1e-6)
    assert layer.weight is base.weight


def test_the_merged_outer_adapter_computes_what_the_adapted_model_does(untied_run):
    model = load_run(untied_run).model
    base = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    targets = torch.randint(0, model.config.vocab_size, (2, 16))
    before, _ = model(idx)
    settings = LoraSettings(rank=4, alpha=8.0, targets="all,outer")
    add_lora(model, settings)
    assert torch.equal(model(idx)[0], before)  # B = 0 in the tables too: step 0 is the base
    assert {"E.lora_A", "E.lora_B", "lm_head.lora_A", "lm_head.lora_B"} <= set(adapter_state(model))
    assert count_adapter(model)[0] == adapter_size(model.config, settings)[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
    adapted_logits, adapted_loss = model(idx), model(idx, targets)[1]
    plain = GPT(model.config)
    plain.load_state_dict(merge_adapter(base, adapter_state(model), settings.scale))
    assert not torch.allclose(adapted_logits[0], before, atol=1e-3)
    assert torch.allclose(plain(idx)[0], adapted_logits[0], atol=1e-5)
    assert torch.allclose(plain(idx, targets)[1], adapted_loss, atol=1e-5)  # the head read in slices by the loss


def test_a_tied_head_refuses_a_correction_of_its_own(base_run_tied):
    model = load_run(base_run_tied).model
    for targets in ("outer", "all,E", "lm_head"):
        with pytest.raises(TinyLMError, match="tied"):
            add_lora(model, LoraSettings(rank=2, alpha=4.0, targets=targets))


@pytest.fixture(scope="module")
def base_run_tied(tmp_path_factory, corpus, data_dir):
    out = tmp_path_factory.mktemp("tied") / "run"
    train(tiny_config(corpus, data_dir, max_steps=2), out, **QUIET)
    return out


def test_finetune_corrects_both_tables_at_loras_rate_and_needs_no_rows(untied_run, tmp_path):
    pairs = [("the king", "rode to war"), ("my lord", "speak soft"), ("quiet fields", "bells rang")]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs * 12))
    flags = {"max_steps": 3, "batch_size": 4, "eval_interval": 3, "sample_tokens": 0, "lora_rank": 2}
    said: list[str] = []
    finetune(untied_run, str(chats), tmp_path / "chat", overrides=flags, data_dir=tmp_path / "d", log=said.append,
             progress=False)
    header = next(line for line in said if line.startswith("training:"))
    assert "adamw, lr adapter" in header and "muon" not in header  # the base trained with Muon; nothing here does
    ckpt = load_checkpoint(checkpoint_path(tmp_path / "chat", "latest"))
    tc = ckpt.config.train
    assert (tc.lora_targets, tc.lr, tc.lora_new_tokens) == ("all,outer", LORA_LR, 0)
    merged, start = load_run(tmp_path / "chat").model.state_dict(), ckpt.base().model_state()
    assert not torch.equal(merged["lm_head.weight"][-2:], start["lm_head.weight"][-2:])  # the chat markers learn
    # what the user gives wins: a rate and targets of their own, and then the rows train as before
    given = {**flags, "lr": 2e-3, "lora_targets": "attention"}
    finetune(untied_run, str(chats), tmp_path / "own", overrides=given, data_dir=tmp_path / "d", **QUIET)
    tc = load_checkpoint(checkpoint_path(tmp_path / "own", "latest")).config.train
    assert (tc.lora_targets, tc.lr, tc.lora_new_tokens) == ("attention", 2e-3, 2)


def test_b_learns_at_its_multiple_of_as_rate(untied_run, corpus, data_dir):
    model = load_run(untied_run).model
    add_lora(model, LoraSettings(rank=2, alpha=4.0, targets="W_q"))
    config = tiny_config(corpus, data_dir, lr=1e-3, lora_rank=2, lora_b_lr_ratio=16.0, optimizer="adamw").train
    groups = make_optimizer(model, config).param_groups
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert lr_of[id(p)] == pytest.approx(1.6e-2 if name.endswith("lora_B") else 1e-3)
    with pytest.raises(TinyLMError, match="lora_b_lr_ratio must be a positive number"):
        tiny_config(corpus, data_dir, lora_b_lr_ratio=0.0)


def test_loras_default_budget_is_twice_the_steps_of_full_fine_tuning(untied_run, tmp_path):
    from tinylm.finetune import LORA_STEPS, recipe

    base = load_run(untied_run).config
    full = recipe(base, base.model.vocab_size + 2, 4000.0, tmp_path, None, {}).train
    lora = recipe(base, base.model.vocab_size + 2, 4000.0, tmp_path, None, {"lora_rank": 4}).train
    assert lora.max_steps == LORA_STEPS * full.max_steps and lora.lr == LORA_LR
    given = recipe(base, base.model.vocab_size + 2, 4000.0, tmp_path, None, {"lora_rank": 4, "max_steps": 7}).train
    assert given.max_steps == 7
